"""Shared fixtures: a tiny random-init Gemma 3 with a real tokenizer file and chat template, and
small data files. Everything is built in code, so the suite needs no network and no weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from probes.config import load_config
from probes.settings import WorkflowConfig
from probes.step.threads import RULE_THREADS_ENV


def pytest_configure(config: pytest.Config) -> None:
    """Stages run in the test process time on one thread, as if their rule were given one core:
    the default (every core) would take both cores beside the other test worker, and thrash.
    A hook, not an import side effect: bench scripts import this module for copy_workflow.

    Under xdist the work is handed out in collection order (LONGEST_FIRST below), not re-sorted
    by how many tests each group holds (xdist's default, which would start the groups of many
    short tests before the SLURM run)."""
    os.environ.setdefault(RULE_THREADS_ENV, "1")
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


# The longest runs first, measured on the 2-core machine (`make test`: pytest -n 2 --dist
# loadgroup hands tests out in collection order, a few at a time): started last, one of them
# kept one worker busy for minutes after the other had finished. Path prefixes of node ids,
# longest first; what matches none keeps its place after them.
LONGEST_FIRST = (
    "tests/workflow/test_slurm_cluster.py",  # 150-240 s: the workflow as SLURM jobs
    "tests/workflow/test_e2e.py",  # 105-120 s: every rule, locally
    # 30-40 s, two processes: the real GGUF read both ways
    "tests/unit/test_assets.py::test_the_default_model_reads_as_transformers_plain_path",
    "tests/workflow/test_data_parallel.py",  # 45-65 s: the upstream run, then two ranks
    "tests/workflow/test_report.py",  # 25-30 s: three Snakemake runs
    "tests/unit/memory/test_step_changes.py",  # 35-45 s: four memory stage runs
    "tests/unit/memory/test_fsdp.py",  # 40-55 s: FSDP2 traces, two spawned gloo ranks
    # 35-45 s together: one xdist group (report_renders), the fixture reports rendered once
    "tests/unit/report/test_first_screen.py",
    "tests/unit/report/test_report.py",
    "tests/workflow/test_mask_script.py",
    "tests/workflow/test_bucket.py",
    "tests/workflow/test_profile.py",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder items in place: LONGEST_FIRST's, in its order (each module's tests kept together
    and in their order, so a module fixture is built once), then the rest as collected."""

    def rank(item: pytest.Item) -> int:
        for index, prefix in enumerate(LONGEST_FIRST):
            if item.nodeid.startswith(prefix):
                return index
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable


def restore_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--dist loadgroup` keeps a group's tests on one worker by renaming each <nodeid>@<group>
    (xdist's worker hook sets item._nodeid). pytest 9.2 reads a node id from item._id instead,
    so the rename is lost and each test of a group goes to whichever worker is free: a module
    fixture of 20 s was built on both workers (pytest-dev/pytest-xdist#1386). The same rename,
    where pytest 9.2 reads it; skipped where xdist's own took effect."""
    try:
        from _pytest.nodeid import NodeId  # pytest >= 9.2
    except ImportError:
        return
    if not getattr(config.option, "loadgroup", False):
        return

    for item in items:
        groups = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        nodeid = item.nodeid
        if not groups or nodeid.rfind("@") > nodeid.rfind("]"):
            continue
        item._id = NodeId.parse(f"{nodeid}@{'_'.join(groups)}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest_first(items)
    restore_xdist_groups(config, items)


REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = REPO / "config" / "chat_templates" / "gemma.jinja"
CANARY = "CANARY-7f3a9c-DO-NOT-LEAK"
# The entry script of each stage (what its rule's `script:` names).
STAGE_SCRIPTS = {
    "mask": "run_mask.py",
    "padding": "run_padding.py",
    "bucket": "run_bucket_sweep.py",
    "memory": "run_memory.py",
    "profile": "run_profile.py",
    "realize": "run_realize.py",
    "data_parallel": "run_data_parallel.py",
    "report": "run_report.py",
}
# A 4-layer Gemma 3 text config (3 sliding, window 8 : 1 full) for the mask gate: config only.
TINY_GEMMA3_CONFIG = {
    "model_type": "gemma3_text",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = (
    "hello how are you today i am fine thanks what is your favorite food pizza pasta "
    "the a of to and in is it that for on with as at by from model user system"
).split()


def build_tiny_tokenizer(directory: Path) -> None:
    """A word-level fast tokenizer with Gemma's special tokens and the shipped chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + sorted(set(WORDS)))}
    for char in "abcdefghijklmnopqrstuvwxyz0123456789-.,?!'\n":
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    tokenizer.save_pretrained(directory)


def tiny_gemma(vocab_size: int, sliding_window: int = 16):
    """A 4-layer Gemma 3 (3 sliding : 1 full) with tiny hidden sizes, random init (seed 0)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return Gemma3ForCausalLM(config)


def build_tiny_gemma(directory: Path, vocab_size: int, sliding_window: int = 16) -> None:
    """tiny_gemma saved as a local HF directory, bf16 on disk (loaded in the profile's dtype)."""
    import torch

    tiny_gemma(vocab_size, sliding_window).to(torch.bfloat16).save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete local HF model directory: config.json, tokenizer files, safetensors."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny-gemma3")
    build_tiny_tokenizer(directory)
    vocab_size = len(AutoTokenizer.from_pretrained(directory))
    build_tiny_gemma(directory, vocab_size=vocab_size)
    return directory


def chat_rows(n_rows: int, text: str = "hello how are you today") -> list[dict]:
    """Chat rows of varied length; `text` may carry a canary."""
    rows = []
    for index in range(n_rows):
        turns = []
        for turn in range(1 + index % 4):
            turns.append({"role": "user", "content": f"{text} {'i am fine ' * (index % 7)}"})
            turns.append({"role": "assistant", "content": f"{text} pizza {'pasta ' * turn}"})
        rows.append({"messages": turns, "source": f"src{index % 3}"})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def chat_jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))


WORKFLOW_PARTS = ("Snakefile", "workflow", "scripts", "config", "profiles", "examples")


def copy_workflow(destination: Path) -> Path:
    """The workflow as a user checks it out (no results, resources or venv), for a test run."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_PARTS:
        source = REPO / name
        if source.is_symlink():  # profiles -> workflow/profiles
            (destination / name).symlink_to(source.readlink())
        elif source.is_dir():
            shutil.copytree(
                source, destination / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(source, destination / name)
    return destination


def workflow_config(**sections: dict) -> WorkflowConfig:
    """The embedded default config, schema-filled, with `sections` merged in (one level deep)."""
    raw = load_config()
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return WorkflowConfig.from_dict(raw)


# For the workflow tests (e2e, SLURM), which check the wiring and the leaks on a 40-example tiny
# run: a smaller busy-wait control, one timing round (a 1 s budget), and a coverage threshold the
# tiny design (a few micro-batches per strategy, 0.92 measured) cannot miss by chance;
# tests/unit/replay checks the controls and the rounds at their defaults. Under SLURM the test
# checks job status every second (test_slurm_cluster.STATUS_CHECK_S): a job's length counts as is.
WIRING_TRIMS = {
    "replay": {
        # the tiny control's point estimates missed by up to 7% and its 3-repeat fit's a, b
        # by up to 37% when the other test worker preempted a busy-wait (the intervals still
        # covered): tolerances these runs cannot miss by chance, as the coverage below
        "control": {
            "n_strata": 2,
            "samples_per_stratum": 2,
            "fit_repeats": 3,
            "saving_tolerance": 0.1,
            "fit_tolerance": 0.6,
        },
        "coverage": {"threshold": 0.8, "replications": 100},
        # the wiring: every change timed (at a 1 s budget on a shared machine the plan would
        # keep few); strata.affordable_changes has its own tests
        "plan_to_budget": False,
        # one thread (and profile.cpu.threads 1 in each test): these runs share the machine
        # with another test worker, and 2 threads beside another job thrash
        "cpu": {"budget_s": 1, "threads": 1},
    },
    "report": {"figure_dpi": 40},
    # one FSDP2 world size (each is a fake-tensor trace under a fake process group, ~3 s on the
    # tiny model); tests/unit/memory/test_fsdp.py checks the predictions themselves
    "memory": {"world_sizes": [2]},
}
