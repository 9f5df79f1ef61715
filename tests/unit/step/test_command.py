"""trainer.command (probes.step.command, probes.step.intercept): a plain top-level script run as
it is, its settings applied, its trainer taken at train(), nothing saved, pushed or logged; every
bad command one CommandError naming the command; the factory and the command give the stages
the same thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_factories import write_factory

from conftest import chat_rows, write_jsonl
from probes.step import source as src
from probes.step.command import Command, CommandError, shown
from probes.step.factory import MODEL_KEYS, FactoryError, tokenizer_of
from probes.step.trainer import load_trainer_step, probe_settings

# a user's script: code at top level, argparse, a plain Trainer, train(), then what a run does
# after training (save, push, a marker file) that must never happen under the probes
SCRIPT = """
import argparse, os, sys
import datasets, torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                          TrainingArguments)

parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--data")
parser.add_argument("--out")
parser.add_argument("--mode", default="train")
cli = parser.parse_args()
if cli.mode == "exit0":
    sys.exit(0)
if cli.mode == "exit2":
    sys.exit(2)
if cli.mode == "raise":
    raise ValueError("no such column 'prompt'")
if cli.mode == "raise_in_library":
    import json
    json.loads("{not json")
if cli.mode == "network":
    AutoModelForCausalLM.from_pretrained("some-org/a-model-not-here")
if cli.mode == "device":
    torch.zeros(1, device="cuda:7")
if cli.mode == "hang":
    import time
    time.sleep(30)
if cli.mode == "nothing":
    print("done")
else:
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.bfloat16)
    data = datasets.load_dataset("json", data_files=cli.data, split="train")
    ids = lambda b: tokenizer.apply_chat_template(b["messages"], return_dict=True)["input_ids"]
    data = data.map(lambda b: {"input_ids": ids(b), "labels": ids(b)}, batched=True,
                    remove_columns=["messages"])
    args = TrainingArguments(output_dir=cli.out, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, report_to="wandb", push_to_hub=True,
                             save_strategy="steps", save_steps=1, use_cpu=True)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True)
    if cli.mode == "no_tokenizer":
        from transformers import default_data_collator as collator
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                      processing_class=None if cli.mode.startswith("no_") else tokenizer)
    if cli.mode == "twice":
        try:
            trainer.train()
        except BaseException:
            pass
        trainer.train()
    elif cli.mode == "no_train":
        sys.exit(0)
    else:
        trainer.train()
    trainer.save_model()
    trainer.push_to_hub()
    open(os.path.join(cli.out, "after-train.marker"), "w").write("ran")
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory, tiny_model_dir):
    directory = tmp_path_factory.mktemp("command")
    data = write_jsonl(directory / "chat.jsonl", chat_rows(12))
    path = directory / "train.py"
    path.write_text(SCRIPT)
    return directory, path, tiny_model_dir, data


def command(script, mode="train"):
    directory, path, model, data = script
    out = directory / f"user-out-{mode}"
    return [
        sys.executable, str(path), "--model", str(model), "--data", str(data),
        "--out", str(out), "--mode", mode,
    ], out  # fmt: skip


def settings(tmp_path, **extra):
    return probe_settings(
        str(tmp_path / "probe"), torch.device("cpu"), torch.float32, None, 0, extra
    )


def test_the_scripts_trainer_has_the_settings_and_nothing_after_train_runs(script, tmp_path):
    argv, out = command(script)
    wandb, argv_before = os.environ.get("WANDB_MODE"), sys.argv[:]
    trainer = Command.of(argv).build(
        settings(tmp_path, gradient_accumulation_steps=3, attn_implementation="eager")
    )
    args = trainer.args
    assert args.gradient_accumulation_steps == 3 and args.per_device_train_batch_size == 2
    assert args.report_to == [] and not args.push_to_hub and args.save_strategy == "no"
    assert args.output_dir == str(tmp_path / "probe")
    # the model settings over the script's own bf16
    assert trainer.model.dtype == torch.float32
    assert trainer.model.config._attn_implementation == "eager"
    # the script's code after train() never ran: no checkpoint, no save, no push, no marker
    assert not out.exists() and not [p for p in (tmp_path / "probe").rglob("*") if p.is_file()]
    assert "train" not in vars(trainer)  # its own train() again (realize runs its loop)
    assert os.environ.get("WANDB_MODE") == wandb and sys.argv == argv_before


def test_the_factory_and_the_command_give_the_stages_the_same_step(script, tmp_path):
    directory, _, model, data = script
    spec = write_factory(directory, model, data, "plain", micro=2)
    base = settings(tmp_path)
    from_factory = load_trainer_step(spec, base).describe()
    argv, _ = command(script)
    from_command = load_trainer_step(src.trainer_source({"command": argv}), base).describe()
    assert from_command["settings"]["max_grad_norm"] == from_factory["settings"]["max_grad_norm"]
    assert from_command["kind"] == from_factory["kind"] == "trainer"
    assert from_command["command"]["spec"] == shown(argv)
    assert from_factory["factory"]["spec"] == spec


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("exit0", "exited (code 0) before train(): it constructed no transformers.Trainer"),
        ("exit2", "exited (code 2) before train()"),
        ("nothing", "ran to its end before train(): it constructed no transformers.Trainer"),
        ("raise", "it raised ValueError: no such column 'prompt' (last frame: "),
        ("no_train", "constructed 1 Trainer(s) and called train() on none"),
        ("twice", "train() was called 2 times"),
        ("network", "The probes run it offline: give local paths"),
        ("device", "It asked for a device the probes do not give it here"),
    ],
)
def test_a_bad_command_is_one_error_naming_it(script, tmp_path, mode, said):
    if mode == "device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device the command asks for")
    argv, out = command(script, mode)
    with pytest.raises(CommandError) as caught:
        Command.of(argv).build(settings(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"trainer.command '{shown(argv)}': ") and said in message
    assert not out.exists()


def script_line(text: str) -> int:
    """The line of SCRIPT (as written to train.py) that holds `text`."""
    return next(i for i, line in enumerate(SCRIPT.split("\n"), 1) if text in line)


def test_a_raising_command_names_its_last_frame_and_its_own_line(script, tmp_path):
    argv, _ = command(script, "raise")
    path = str(script[1])
    with pytest.raises(CommandError) as caught:
        Command.of(argv).build(settings(tmp_path))
    line = script_line("raise ValueError")
    assert f"(last frame: {path}:{line} in <module>)" in str(caught.value)
    # raised inside a library: the library's frame, and the line of the command's own file
    argv, _ = command(script, "raise_in_library")
    with pytest.raises(CommandError) as caught:
        Command.of(argv).build(settings(tmp_path))
    message = str(caught.value)
    assert "it raised JSONDecodeError" in message and "json" in message.split("last frame: ")[1]
    assert f"in the command's own train.py: line {script_line('json.loads')}" in message


def test_a_trainer_with_no_tokenizer_anywhere_is_named(script, tmp_path):
    argv, _ = command(script, "no_tokenizer")
    with pytest.raises(FactoryError) as caught:
        Command.of(argv).build(settings(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"trainer.command '{shown(argv)}': the Trainer has no ")
    assert "collator default_data_collator no tokenizer" in message
    assert "pass processing_class=tokenizer" in message


def test_the_padding_stage_reads_the_vocabulary_through_the_collators_tokenizer(script):
    from conftest import workflow_config
    from probes.padding.stage import trainer_lengths

    argv, _ = command(script, "no_processing")
    cfg = workflow_config(
        trainer={"command": argv, "factory": None},
        training={"micro_batch_size": 2, "grad_accum": 2, "max_seq_len": 256},
    )
    lengths, tokenizer, _, provenance = trainer_lengths(cfg)
    assert len(tokenizer) > 0 and len(lengths) == 12  # no len(None) on the way
    assert provenance["trainer"]["collator"] == "DataCollatorForSeq2Seq"


def test_accelerate_launch_runs_its_training_script_in_this_process(script, tmp_path):
    argv, out = command(script)
    launched = ["accelerate", "launch", "--num_processes", "1", *argv[1:]]
    trainer = Command.of(launched).build(settings(tmp_path, gradient_accumulation_steps=5))
    assert trainer.args.gradient_accumulation_steps == 5 and not out.exists()
    assert Command.of(launched).source_file == argv[1]  # the user's script, not the launcher


def test_a_command_that_hangs_is_stopped_after_its_timeout(script, tmp_path):
    argv, _ = command(script, "hang")
    with pytest.raises(CommandError, match="still running after 1 s without calling train"):
        Command.of(argv, timeout_s=1).build(settings(tmp_path))


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["python", "missing.py"], "script 'missing.py' does not exist"),
        (["no-such-command-here", "x"], "is neither python, a .py script nor a console script"),
        (["torchrun", "train.py"], "starts several processes"),
        ([], "empty"),
    ],
)
def test_a_command_that_cannot_start_is_named_before_anything_runs(argv, said):
    with pytest.raises(CommandError, match=said):
        Command.of(argv)


def test_exactly_one_of_factory_and_command():
    trainer = {"factory": "train.py:build_trainer", "command": ["python", "train.py"]}
    with pytest.raises(FactoryError, match="trainer.factory and trainer.command are both set"):
        src.trainer_source(trainer)
    assert "both set" in src.static_problem(trainer, Path.cwd())


def test_a_trainer_whose_tokenizer_is_in_its_collator_is_handled(script, tmp_path):
    argv, _ = command(script, "no_processing")
    trainer = Command.of(argv).build(settings(tmp_path))
    assert trainer.processing_class is None
    assert tokenizer_of(trainer) is trainer.data_collator.tokenizer


def test_the_shown_command_hides_secrets_and_shortens_paths():
    argv = ["trl", "sft", "--hub_token", "hf_abcdefgh12345678", "--api-key=sk-live-12345678"]
    argv += ["--model_name_or_path", "/home/me/models/gemma", "--lr", "2e-4", "hf_secret1234"]
    text = shown(argv)
    assert "hf_abcdefgh" not in text and "sk-live" not in text and "hf_secret" not in text
    assert "--api-key=***" in text and ".../gemma" in text and "/home/me" not in text
    assert "--lr 2e-4" in text


def test_a_command_build_makes_one_trainer_folder_and_removes_it(script, tmp_path, monkeypatch):
    import tempfile

    cleanups = []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(src.atexit, "register", lambda fn, *a, **k: cleanups.append((fn, a, k)))
    argv, _ = command(script)
    trainer = Command.of(argv).build(settings(tmp_path, output_dir=src.output_dir()))
    folders = list(tmp_path.glob(f"{src.OUTPUT_PREFIX}*"))
    assert [trainer.args.output_dir] == [str(f) for f in folders] and len(cleanups) == 1
    for fn, args, kwargs in cleanups:  # what the process runs at its exit
        fn(*args, **kwargs)
    assert not list(tmp_path.glob(f"{src.OUTPUT_PREFIX}*"))


def test_a_build_leaves_no_trainer_folder_behind(tmp_path):
    code = (
        "import os; from probes.step.source import output_dir; assert os.path.isdir(output_dir())"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    assert not list(tmp_path.glob(f"{src.OUTPUT_PREFIX}*"))


def test_the_report_names_the_command_that_was_probed():
    from probes.report.sections.shared import timed_parts

    described = {"kind": "trainer", "trainer": "SFTTrainer", "command": {"spec": "trl sft --x 1"}}
    assert timed_parts(described) == {
        "kind": "trainer",
        "name": "SFTTrainer",
        "factory": "trl sft --x 1",
    }


def test_the_shipped_top_level_script_is_probed_unmodified(script, tmp_path):
    directory, _, model, data = script
    example = Path(__file__).resolve().parents[3] / "examples" / "train_script.py"
    user_out = directory / "example-out"
    argv = [sys.executable, str(example), "--model", str(model), "--data", str(data)]
    argv += ["--output_dir", str(user_out), "--max_length", "64", "--lora_r", "4"]
    step = load_trainer_step(Command.of(argv), settings(tmp_path, per_device_train_batch_size=3))
    assert (
        type(step.trainer).__name__ == "Trainer"
        and step.trainer.args.per_device_train_batch_size == 3
    )
    assert max(len(r) for r in step.trainer.train_dataset["input_ids"]) <= 64
    assert torch.isfinite(step.forward_backward(step.collate(["0", "1", "2"], packed=False)))
    assert not user_out.exists()  # its save_model() after train() never ran


def emitted_settings() -> dict[str, dict]:
    """Each change recommendations.json can emit (probes.apply: batching, step-level, combined)
    as the settings a plain Trainer's command is built with: its TrainingArguments fields and
    the model's from_pretrained keys; one change per distinct set."""
    from unit.apply.test_current_names import every_change

    found: dict[str, dict] = {}
    for change in every_change():
        if change.get("training_arguments") is None:  # TRL's only (packing), or not applicable
            assert change.get("sft_config") or not change.get("applies"), change["id"]
            continue
        model = change.get("model_kwargs") or {}
        wanted = {**change["training_arguments"], **model}
        if wanted not in found.values():
            found[change["id"]] = wanted
    return found


def test_every_emitted_changes_settings_reach_the_trainer_the_script_builds(script, tmp_path):
    directory, _, model, data = script
    example = Path(__file__).resolve().parents[3] / "examples" / "train_script.py"
    argv = [sys.executable, str(example), "--model", str(model), "--data", str(data)]
    argv += ["--output_dir", str(directory / "emitted-out"), "--max_length", "64"]
    changes = emitted_settings()
    assert {"micro_batch_size_4", "attention_eager", "gradient_checkpointing_on"} <= set(changes)
    for name, wanted in changes.items():
        trainer = Command.of(argv).build(settings(tmp_path / name, **wanted))
        for key, value in wanted.items():
            if key in MODEL_KEYS:
                assert getattr(trainer.model.config, f"_{key}") == value, (name, key)
            else:
                assert getattr(trainer.args, key) == value, (name, key)
    assert not (directory / "emitted-out").exists()


def test_a_tokenizers_fingerprint_is_its_content_while_intercepted(tiny_model_dir):
    import contextlib

    from datasets.fingerprint import Hasher
    from transformers import AutoTokenizer

    from probes.step.intercept import patch_fingerprints

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with contextlib.ExitStack() as stack:
        patch_fingerprints(stack)
        first, again = (
            Hasher.hash(tokenizer),
            Hasher.hash(AutoTokenizer.from_pretrained(tiny_model_dir)),
        )
        tokenizer.chat_template += " "
        templated = Hasher.hash(tokenizer)
        tokenizer.add_tokens(["<probes-new-token>"])
        added = Hasher.hash(tokenizer)
    assert first == again and len({first, templated, added}) == 3


@pytest.mark.parametrize(
    ("name", "starts"),
    [("command.yaml", "trl sft "), ("command-script.yaml", "python .../train_script.py ")],
)
def test_the_shipped_command_configs_pass_the_parse_time_checks(name, starts, monkeypatch):
    from probes.config import check_config_paths, load_config

    repo = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo)  # the commands' paths start at the workflow's directory
    config = load_config(repo / "config" / name)  # merged over config/config.yaml
    check_config_paths(config, repo)
    source = src.trainer_source(config["trainer"])
    assert source.kind == "command" and not config["trainer"].get("factory")
    assert source.describe()["spec"].startswith(starts)
