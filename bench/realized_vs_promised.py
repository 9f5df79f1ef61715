"""Benchmark (the headline figure): the saving the replay promises against the saving whole epochs
of the real ``transformers.Trainer`` realize, with exactly the settings recommendations.json emits.

Data: a seeded subset (``--examples``) of the padding stage's real lengths (``--lengths``, with
its loss-token counts), every length capped at ``--cap`` so a CPU epoch takes seconds. Model: a
small random-init Llama (real architecture, ``build_model``), float32 on CPU, one thread; or
with ``--device cuda --architecture DIR`` that directory's architecture (the default Gemma),
random init in bfloat16 on the GPU (step time follows shapes, not weight values). Both trainers
run the model's own dtype without autocast, as the replay does.

1. **Promised**: the replay stage itself (``probes.replay.stage.run_replay``: positive control,
   scaling fit, instrument CV, sequential GREG design, coverage control) on the same model saved to
   a temporary directory, the same subset's plans, the same device, with the harness
   ``bench/trainer_harness.py`` (what a plain Trainer does: full fine-tuning, AdamW, the model's
   own loss). Its estimates go through ``probes.apply`` (``recommendations_document`` and
   ``order_changes``, as the report builds recommendations.json) to each change's promised saving
   and 95% interval.
2. **Realized**: for the baseline and every change whose settings paste into
   ``transformers.Trainer`` (its ``training_arguments``; the drop-in
   ``probes.sampler.length_grouped_trainer`` where the change names it; the data filter of
   ``drop_no_loss_examples``) or, for TRL packing, into ``trl.SFTTrainer`` (its ``sft_config``),
   one whole epoch per run, timed by the Trainer's own
   ``train_runtime``; ``--repeats`` rounds, the configurations in a new seeded order each round so
   drift is shared. Realized saving = 1 − T_change / T_random of the mean times, its 95% interval
   from the rounds' paired log ratios; each change judged by the stage's three-way rule
   (probes.realize.verdict: agrees / disagrees / undecided, the realized interval included), so a
   run with too few rounds (``--quick``) says undecided rather than passing or failing.

Prints the table (change | promised [95% CI] | realized [95% CI] | verdict | within ±5 pp |
inside CI) and,
to say why they differ, each configuration's replayed and realized epoch seconds and the Trainer's
extra seconds per optimizer step. ``--out`` also writes the table as markdown. No timing is
asserted.

    python bench/realized_vs_promised.py --lengths results/padding/lengths.parquet \
        --recommendation results/bucket/recommendation.json [--quick] [--out table.md] \
        [--device cuda --architecture resources/model/gemma-3-270m]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

from trainer_harness import LEARNING_RATE  # noqa: E402

from probes.apply.document import order_changes, recommendations_document  # noqa: E402
from probes.batching import plans as pl  # noqa: E402
from probes.contracts import STAGE_OUTPUTS, TRAINING_STATUSES  # noqa: E402
from probes.realize import verdict as vd  # noqa: E402
from probes.report.sections.replay import change_measurement  # noqa: E402

IGNORE_INDEX = -100
VOCAB = 512
HARNESS = REPO / "bench" / "trainer_harness.py"
FACTORY = f"{REPO / 'bench' / 'sft_factory.py'}:build_trainer"  # --trainer sft
TOLERANCE_PP = 5.0


# ---------------------------------------------------------------------------------------------
# Data, model, settings
# ---------------------------------------------------------------------------------------------


def load_subset(path: Path, n: int, cap: int, seed: int) -> pl.PlanExamples:
    """A seeded subset of the training examples, lengths (and loss tokens) capped at `cap`."""
    frame = pd.read_parquet(path, columns=["example_id", "status", "n_tokens", "n_loss_tokens"])
    used = frame.loc[frame["status"].astype(str).isin(TRAINING_STATUSES)].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(used), size=min(n, len(used)), replace=False))
    part = used.iloc[picked]
    lengths = np.minimum(part["n_tokens"].to_numpy(np.int64), cap)
    loss = pd.to_numeric(part["n_loss_tokens"], errors="coerce").fillna(0).to_numpy(np.int64)
    return pl.PlanExamples(
        part["example_id"].astype(str).to_numpy(object), lengths, np.clip(loss, 0, lengths)
    )


def build_model(
    max_len: int, hidden: int, architecture: Path | None = None, dtype: Any = None
) -> Any:
    """A small Llama, random init (seed 0): real architecture, seconds per CPU epoch. With
    `architecture` (a model directory's config.json, e.g. the default Gemma on a GPU) that
    architecture instead, random init too: step time depends on shapes, not weight values."""
    import torch
    import transformers

    torch.manual_seed(0)
    if architecture is not None:
        config = transformers.AutoConfig.from_pretrained(architecture)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        model.config.use_cache = False
        return model
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(max_len, 64),
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(dtype or torch.float32)
    model.config.use_cache = False
    return model


def model_words(args: argparse.Namespace) -> str:
    if args.architecture is None:
        return f"small random-init Llama (hidden {args.hidden}, 4 layers, vocab {VOCAB})"
    return f"random-init {args.architecture.name} architecture"


def vocab_size(args: argparse.Namespace) -> int:
    """Token ids are drawn below this: the small Llama's VOCAB, or the architecture's own."""
    if args.architecture is None:
        return VOCAB
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.architecture)
    return int(getattr(config, "get_text_config", lambda: config)().vocab_size)


def precision(args: argparse.Namespace) -> dict[str, Any]:
    """The trainers' device and precision: the model's own dtype, no autocast (build_model puts
    it in float32 on CPU, where bf16 is emulated without bf16 units, and in bfloat16 on CUDA),
    so the trainers run the step the replay runs (profile.dtype the same)."""
    return {"use_cpu": args.device != "cuda", "bf16": False}


def epoch_arguments(out: str, args: argparse.Namespace) -> dict[str, Any]:
    """What every timed epoch sets, in TrainingArguments and SFTConfig alike: one epoch, no
    logging, saving or progress bar in the timing, the data in the main process."""
    return {
        "output_dir": out,
        "num_train_epochs": 1,
        "learning_rate": LEARNING_RATE,
        "seed": args.seed,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **precision(args),
    }


def model_dtype(args: argparse.Namespace) -> Any:
    import torch

    return torch.bfloat16 if args.device == "cuda" else torch.float32


def subset_recommendation(rec: dict[str, Any], examples: pl.PlanExamples) -> dict[str, Any]:
    """The bucket stage's recommendation with its input counts those of the subset (the
    recommended bucket size and sweep points are the full data's)."""
    out = copy.deepcopy(rec)
    out["input"] = {
        **(out.get("input") or {}),
        "examples_used": int(examples.lengths.size),
        "real_tokens": int(examples.lengths.sum()),
    }
    out["batch_shapes"] = {
        **(out.get("batch_shapes") or {}),
        "padded_length_max": int(examples.lengths.max()),
    }
    return out


def training_section(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "micro_batch_size": args.micro_batch_size,
        "grad_accum": args.grad_accum,
        "max_seq_len": args.cap,
        "loss_on": "assistant",
        "world_size": 1,
    }


# ---------------------------------------------------------------------------------------------
# Promised: the replay stage on the same model, data and device
# ---------------------------------------------------------------------------------------------


def trainer_examples(work: Path, examples: pl.PlanExamples, args: argparse.Namespace):
    """``--trainer sft``: the subset as the bench factory's SFTTrainer prepares it (TRL drops
    the examples without a loss token), its rows' lengths read back from the trainer's own
    prepared dataset, the example ids its row numbers (probes.padding.trainer_rows)."""
    from probes.padding.trainer_rows import lengths_table
    from probes.step.factory import build_trainer, load_factory

    data = Examples.from_plan(examples, args.seed, vocab_size(args))
    rows = [
        {
            "input_ids": r["input_ids"],
            "completion_mask": [int(label != IGNORE_INDEX) for label in r["labels"]],
        }
        for r in data.rows
    ]
    (work / "rows.json").write_text(json.dumps(rows))
    run = {
        "rows": str(work / "rows.json"),
        "micro_batch_size": args.micro_batch_size,
        "grad_accum": args.grad_accum,
        "cap": args.cap,
        "hidden": args.hidden,
        "architecture": str(args.architecture) if args.architecture else None,
        "device": args.device,
        "seed": args.seed,
        "learning_rate": LEARNING_RATE,
        "vocab": vocab_size(args),
    }
    (work / "run.json").write_text(json.dumps(run))
    os.environ["PROBES_BENCH_RUN"] = str(work / "run.json")
    trainer = build_trainer(load_factory(FACTORY), {"output_dir": str(work / "probe")})
    table = lengths_table(trainer.train_dataset, args.cap)
    (work / "lengths.parquet").parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(work / "lengths.parquet")
    return pl.PlanExamples(
        table["example_id"].to_numpy(object),
        table["n_tokens"].to_numpy(np.int64),
        table["n_loss_tokens"].to_numpy(np.int64),
    )


def run_promised(
    work: Path, examples: pl.PlanExamples, rec: dict[str, Any], args: argparse.Namespace
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    from probes.config import load_config
    from probes.replay.stage import run_replay
    from probes.settings import WorkflowConfig

    model_dir = work / "model"
    longest = int(examples.lengths.max())
    model = build_model(longest, args.hidden, args.architecture, model_dtype(args))
    model.save_pretrained(model_dir)
    if args.trainer == "sft":
        examples = trainer_examples(work, examples, args)
    plans = pl.build_plans(
        examples,
        args.micro_batch_size,
        args.grad_accum,
        args.cap,
        pl.recommended_bucket_size(rec),
        seed=args.seed,
    )
    plans.to_parquet(work / "plans.parquet")
    # The bench times packing, so the replay must not mark it invalid: a packed scenario with no
    # violation. Not a check: the bench model (sdpa on a flattened row, as TRL's padding-free
    # packing without FlashAttention) lets documents attend to each other, in the replay and in
    # SFTTrainer alike. The workflow's mask gate is what checks it for a real run.
    (work / "gate.json").write_text(
        json.dumps({"scenarios": [{"scenario": "packed", "violations": 0}]})
    )
    inputs = {
        "plans": work / "plans.parquet",
        "lengths": work / "lengths.parquet" if args.trainer == "sft" else args.lengths,
        "recommendation": args.recommendation,
        "gate": work / "gate.json",
    }
    outputs = {key: work / Path(rel).name for key, rel in STAGE_OUTPUTS["replay"].items()}
    cfg = load_config()
    cfg["training"] = training_section(args)
    cfg["profile"].update(
        harness=str(HARNESS),
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        allow_cpu=args.device == "cpu",
        harness_options={},
    )
    cfg["replay"]["cpu"].update(max_seq_len=args.cap, threads=1, budget_s=args.budget_s)
    cfg["replay"]["step_changes"] = args.trainer == "sft"
    if args.trainer == "sft":  # the promise is the SFTTrainer's own step (probes.step.trainer)
        cfg["trainer"] = {"factory": FACTORY}
    summary = run_replay(inputs, outputs, WorkflowConfig.from_dict(cfg), model_dir, progress=False)
    estimates = pd.read_parquet(outputs["estimates"])
    summary["step_changes"] = pq_metadata(outputs["estimates"]).get("step_changes", [])
    return estimates, plans, summary


def pq_metadata(path: Path) -> dict[str, Any]:
    from probes.io import read_provenance

    return read_provenance(path)


def promised_changes(
    rec: dict[str, Any], args: argparse.Namespace, examples: pl.PlanExamples, estimates
) -> dict[str, Any]:
    """recommendations.json for the subset, with the replay's measured saving per change."""
    no_loss = int((examples.loss_tokens == 0).sum())
    document = recommendations_document(rec, training_section(args), no_loss_examples=no_loss)
    tables = {"replay_estimates": estimates}
    measurements = {
        i: change_measurement(change, tables, {})
        for i, change in enumerate(document["changes"])
        if change.get("applies")
    }
    return order_changes(document, measurements)


# ---------------------------------------------------------------------------------------------
# Realized: whole epochs of the real Trainer with the emitted settings
# ---------------------------------------------------------------------------------------------


class Examples:
    """Tokenised examples: random ids, the real lengths; labels on the last `loss` tokens (the
    assistant turn), -100 on the prompt."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    @classmethod
    def from_plan(cls, examples: pl.PlanExamples, seed: int, vocab: int = VOCAB) -> Examples:
        rng = np.random.default_rng(seed)
        rows = []
        for n, loss in zip(examples.lengths, examples.loss_tokens, strict=True):
            ids = rng.integers(1, vocab, size=int(n)).tolist()
            labels = [IGNORE_INDEX] * (int(n) - int(loss)) + ids[int(n) - int(loss) :]
            rows.append({"input_ids": ids, "labels": labels})
        return cls(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]

    def filter(self, keep: Any) -> Examples:
        return Examples([row for row in self.rows if keep(row)])


def collate(features: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Right padding to the micro-batch's longest row (as the replay's padded batches)."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros((len(features), width), dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = torch.tensor(f["input_ids"])
        labels[row, :n] = torch.tensor(f["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def keep_example(example: dict[str, list[int]]) -> bool:
    """The filter recommendations.json's drop_no_loss_examples snippet pastes."""
    return any(label != IGNORE_INDEX for label in example["labels"])


def run_epoch(
    name: str,
    change: dict[str, Any] | None,
    base_kwargs: dict[str, Any],
    data: Examples,
    args: argparse.Namespace,
) -> dict[str, float]:
    import transformers

    from probes.sampler import length_grouped_trainer

    if change and change.get("training_arguments") is None:
        return run_sft_epoch(change, data, args)  # TRL only (packing)
    kwargs = dict(change["training_arguments"]) if change else dict(base_kwargs)
    dataset = data.filter(keep_example) if name == "drop_no_loss_examples" else data
    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(**epoch_arguments(out, args), **kwargs)
        common = {
            "model": build_model(args.cap, args.hidden, args.architecture, model_dtype(args)),
            "args": training_args,
            "train_dataset": dataset,
            "data_collator": collate,
        }
        sampler = (change or {}).get("sampler")
        if sampler:
            trainer = length_grouped_trainer(transformers.Trainer)(
                **common, bucket_size_batches=int(sampler["kwargs"]["bucket_size_batches"])
            )
        else:
            trainer = transformers.Trainer(**common)
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def tiny_tokenizer(vocab_ids: int = VOCAB) -> Any:
    """What SFTTrainer needs of a tokenizer for already-tokenised data: a pad token, over the
    bench model's VOCAB ids (one word per id; nothing is ever encoded)."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_ids)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
    )


def run_sft_epoch(change: dict[str, Any], data: Examples, args: argparse.Namespace) -> dict:
    """One epoch of trl.SFTTrainer with exactly the change's sft_config (TRL packing), on the
    same tokenised examples: input_ids and a completion mask (loss on the assistant tokens, as
    the labels of the Trainer runs)."""
    import datasets
    import trl

    rows = [
        {
            "input_ids": r["input_ids"],
            "completion_mask": [int(label != IGNORE_INDEX) for label in r["labels"]],
        }
        for r in data.rows
    ]
    with tempfile.TemporaryDirectory() as out:
        config = trl.SFTConfig(
            **epoch_arguments(out, args),
            completion_only_loss=True,
            # SFTConfig's defaults are not TrainingArguments' (TRL 1.16: bf16=True,
            # gradient_checkpointing=True). With the checkpointing default (float32) packing
            # realized -29.5% against +12.7% promised here: activation recomputation. bf16 comes
            # from precision() (off on CPU: emulated without bf16 units, no valid timing). The
            # bench compares like with like, as the packing caveat tells a user to set them
            gradient_checkpointing=False,
            **change["sft_config"],
        )
        trainer = trl.SFTTrainer(
            model=build_model(args.cap, args.hidden, args.architecture, model_dtype(args)),
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tiny_tokenizer(vocab_size(args)),
        )
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def trainer_changes(document: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Changes whose settings paste into transformers.Trainer or trl.SFTTrainer, and why each
    other one is out."""
    import importlib.util

    has_trl = all(importlib.util.find_spec(m) for m in ("trl", "datasets"))
    runnable, skipped = [], []
    for change in document["changes"]:
        if not change.get("applies"):
            skipped.append(f"{change['id']}: does not apply ({change.get('reason')})")
        elif "settings" in change:
            runnable.append(change)  # a step-level change: settings for the factory
        elif change.get("training_arguments") is None and change.get("sft_config") is None:
            skipped.append(f"{change['id']}: neither TrainingArguments nor an SFTConfig")
        elif change.get("training_arguments") is None and not has_trl:
            skipped.append(f"{change['id']}: SFTConfig only, and trl/datasets are not installed")
        else:
            runnable.append(change)
    return runnable, skipped


def change_settings(change: dict[str, Any]) -> dict[str, Any]:
    """What a change pastes, as the bench factory's settings (``--trainer sft``)."""
    if "settings" in change:  # a step-level change (probes.step.changes)
        settings = dict(change["settings"])
    elif change.get("training_arguments") is None:
        settings = dict(change["sft_config"])
    else:
        settings = dict(change["training_arguments"])
    if change.get("sampler"):
        settings["bucket_size_batches"] = int(change["sampler"]["kwargs"]["bucket_size_batches"])
    # drop_no_loss_examples itself, and the changes under which TRL stops dropping them (packing,
    # padding-free): they paste the filter so they train the baseline's examples
    if change.get("id") == "drop_no_loss_examples" or change.get("drop_no_loss_examples"):
        settings["drop_no_loss_examples"] = True
    return settings


def step_level_changes(estimates: pd.DataFrame, step_changes: list[dict]) -> list[dict]:
    """The replay's step-level changes as rows of the table: their promise is the replay's."""
    by_strategy = estimates.set_index("strategy")
    out = []
    for change in step_changes:
        if change["strategy"] not in by_strategy.index:
            continue
        row = by_strategy.loc[change["strategy"]]
        out.append(
            {
                "id": change["strategy"],
                "applies": True,
                "settings": change["settings"],
                "measured_saving": float(row["saving_vs_random"]),
                "saving_ci_low": float(row["saving_ci_low"]),
                "saving_ci_high": float(row["saving_ci_high"]),
                "decision": "step-level",
            }
        )
    return out


def run_trainer_epoch(settings: dict[str, Any]) -> dict[str, float]:
    """One epoch of the bench factory's SFTTrainer built with `settings` (``--trainer sft``)."""
    from probes.step.factory import build_trainer, load_factory

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(load_factory(FACTORY), {**settings, "output_dir": out})
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def run_realized_trainer(
    document: dict[str, Any], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """Every configuration as the factory builds it with the change's emitted settings."""
    changes, _ = trainer_changes(document)
    configs = [(pl.BASELINE, {})] + [(c["id"], change_settings(c)) for c in changes]
    run_trainer_epoch({})  # untimed: the process's first trainer pays one-time costs
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    rng = np.random.default_rng(args.seed + 11)
    for repeat in range(args.repeats):
        for i in rng.permutation(len(configs)):
            name, settings = configs[i]
            result = run_trainer_epoch(settings)
            runs[name].append(result)
            print(
                f"  round {repeat + 1}/{args.repeats} {name:<26s} "
                f"{result['train_runtime']:7.2f} s, {result['optimizer_steps']} steps",
                flush=True,
            )
    return runs


def run_realized(
    document: dict[str, Any], data: Examples, args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    changes, _ = trainer_changes(document)
    configs: list[tuple[str, dict[str, Any] | None]] = [(pl.BASELINE, None)]
    configs += [(c["id"], c) for c in changes]
    base_kwargs = document["baseline"]["training_arguments"]
    # one untimed epoch first: the process's first Trainer (and first SFTTrainer) pays one-time
    # costs (imports, the datasets cache)
    warm = Examples(data.rows[: max(len(data) // 4, 16)])
    run_epoch(pl.BASELINE, None, base_kwargs, warm, args)
    for change in changes:
        if change.get("training_arguments") is None:
            run_epoch(change["id"], change, base_kwargs, warm, args)
            break
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    rng = np.random.default_rng(args.seed + 11)
    for repeat in range(args.repeats):
        for i in rng.permutation(len(configs)):
            name, change = configs[i]
            result = run_epoch(name, change, base_kwargs, data, args)
            runs[name].append(result)
            print(
                f"  round {repeat + 1}/{args.repeats} {name:<26s} "
                f"{result['train_runtime']:7.2f} s, {result['optimizer_steps']} steps",
                flush=True,
            )
    return runs


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def realized_interval(times: np.ndarray, base_times: np.ndarray) -> tuple[float, float]:
    """The realized saving's 95% interval from the rounds, each change's epoch paired with the
    baseline's of the same round (drift shared): the mean log time ratio ± t·se, as a saving
    (NaN with fewer than two rounds)."""
    from probes.replay.estimate import t_quantile_975

    if len(times) < 2 or len(times) != len(base_times):
        return float("nan"), float("nan")
    logs = np.log(times / base_times)
    half = t_quantile_975(len(logs) - 1) * float(logs.std(ddof=1)) / np.sqrt(len(logs))
    return 1.0 - float(np.exp(logs.mean() + half)), 1.0 - float(np.exp(logs.mean() - half))


def table_rows(
    document: dict[str, Any], estimates: pd.DataFrame, runs: dict[str, list[dict[str, float]]]
) -> list[dict[str, Any]]:
    """One row per realized configuration: promised (replay) and realized (Trainer) savings."""
    base_times = np.array([r["train_runtime"] for r in runs[pl.BASELINE]])
    by_id = {c["id"]: c for c in document["changes"]}
    replay_s = dict(zip(estimates["strategy"], estimates["estimated_time_s"], strict=True))
    from probes.report.sections.replay import CHANGE_STRATEGY

    rows = []
    for name, results in runs.items():
        times = np.array([r["train_runtime"] for r in results])
        per_round = 1.0 - times / base_times
        change = by_id.get(name, {})
        strategy = pl.BASELINE if name == pl.BASELINE else CHANGE_STRATEGY.get(name)
        promised = change.get("measured_saving") if name != pl.BASELINE else 0.0
        low = change.get("saving_ci_low") if name != pl.BASELINE else None
        high = change.get("saving_ci_high") if name != pl.BASELINE else None
        realized = 1.0 - times.mean() / base_times.mean()
        r_low, r_high = realized_interval(times, base_times)
        steps = results[0]["optimizer_steps"]
        replayed = replay_s.get(strategy) if strategy else None
        rows.append(
            {
                "change": name,
                "promised": promised,
                "ci_low": low,
                "ci_high": high,
                "realized": float(realized),
                "realized_sd": float(per_round.std(ddof=1)) if len(per_round) > 1 else 0.0,
                "within_5pp": None
                if promised is None or name == pl.BASELINE
                else bool(abs(realized - promised) * 100 <= TOLERANCE_PP),
                "inside_ci": None if low is None or high is None else bool(low <= realized <= high),
                "realized_low": r_low,
                "realized_high": r_high,
                # the stage's three-way rule (probes.realize.verdict), realized interval included
                "verdict": "baseline"
                if name == pl.BASELINE
                else vd.verdict(
                    realized,
                    promised if promised is not None else math.nan,
                    low if low is not None else math.nan,
                    high if high is not None else math.nan,
                    TOLERANCE_PP / 100,
                    r_low,
                    r_high,
                ),  # fmt: skip
                "trainer_epoch_s": float(times.mean()),
                "trainer_epoch_sd_s": float(times.std(ddof=1)) if len(times) > 1 else 0.0,
                "replay_epoch_s": None if replayed is None else float(replayed),
                "optimizer_steps": int(steps),
                "decision": change.get("decision", "baseline"),
            }
        )
    return rows


def _pct(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{100 * v:+.1f}%"


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "**no**")


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| change | promised saving [95% CI] | realized saving [95% CI over rounds] "
        "| verdict | within ±5 pp? | inside CI? | replayed epoch [s] | Trainer epoch [s] "
        "| (Trainer − replay) per step [s] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ci = (
            f" [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]"
            if r["ci_low"] is not None and r["ci_high"] is not None
            else ""
        )
        promised = (
            "0 (baseline)"
            if r["change"] == pl.BASELINE
            else ("not measured by the replay" if r["promised"] is None else _pct(r["promised"]))
        )
        extra = (
            "—"
            if r["replay_epoch_s"] is None
            else f"{(r['trainer_epoch_s'] - r['replay_epoch_s']) / r['optimizer_steps']:.4f}"
        )
        replayed = "—" if r["replay_epoch_s"] is None else f"{r['replay_epoch_s']:.2f}"
        lines.append(
            f"| {r['change']} | {promised}{ci} | {_pct(r['realized'])} "
            f"[{_pct(r['realized_low'])}, {_pct(r['realized_high'])}] | **{r['verdict']}** "
            f"| {_yes(r['within_5pp'])} | {_yes(r['inside_ci'])} "
            f"| {replayed} | {r['trainer_epoch_s']:.2f} ± {r['trainer_epoch_sd_s']:.2f} "
            f"| {extra} |"
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=Path, default=Path("results/padding/lengths.parquet"))
    parser.add_argument(
        "--recommendation", type=Path, default=Path("results/bucket/recommendation.json")
    )
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--cap", type=int, default=256, help="every length capped here (tokens)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=60.0, help="the replay's time budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="200 examples, 2 rounds, 30 s replay")
    parser.add_argument("--out", type=Path, help="also write the table as markdown here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--trainer",
        choices=["harness", "sft"],
        default="harness",
        help="sft: the promise is the replay through a trl.SFTTrainer factory "
        "(bench/sft_factory.py), its step-level changes included, and every configuration is "
        "realized by that factory's trainer with the change's settings",
    )
    parser.add_argument(
        "--architecture",
        type=Path,
        help="a model directory whose config.json to train (random init), e.g. the default "
        "Gemma on a GPU; default: the small Llama",
    )
    args = parser.parse_args()
    if args.quick:
        args.examples, args.repeats, args.budget_s = 200, 2, 30.0
    return args


def data_line(examples: Any, args: argparse.Namespace, load: tuple[float, ...]) -> str:
    import transformers

    from probes.step.dtype import cpu_bf16_facts

    # oneDNN's flag alone says yes on AVX512 cores without bf16 units (probes.step.dtype)
    bf16 = cpu_bf16_facts().native_bf16
    return (
        f"data: {examples.lengths.size} examples of {args.lengths} (seed {args.seed}), capped at "
        f"{args.cap}: {int(examples.lengths.sum())} tokens, "
        f"{int((examples.loss_tokens == 0).sum())} without a loss token; micro "
        f"{args.micro_batch_size} × grad_accum {args.grad_accum}; model {model_words(args)}, "
        f"{model_dtype(args)} on {args.device} (CPU bf16 native: {bf16}); "
        f"transformers {transformers.__version__}; load {load}"
    )


def promise_and_realize(examples: Any, rec: dict, args: argparse.Namespace) -> tuple:
    """(document, estimates, runs, skipped): the replay's promise, then every change realized."""
    with tempfile.TemporaryDirectory() as tmp:
        estimates, _, summary = run_promised(Path(tmp), examples, rec, args)
        print(f"replay: {summary['wall_s']:.1f} s", flush=True)
        document = promised_changes(rec, args, examples, estimates)
        if args.trainer == "sft":
            document["changes"] += step_level_changes(estimates, summary["step_changes"])
            _, skipped = trainer_changes(document)
            runs = run_realized_trainer(document, args)
        else:
            _, skipped = trainer_changes(document)
            data = Examples.from_plan(examples, args.seed, vocab_size(args))
            runs = run_realized(document, data, args)
    return document, estimates, runs, skipped


def table_header(
    examples: Any, args: argparse.Namespace, load: tuple[float, ...], started: float
) -> str:
    trainer = (
        "trainer mode: the replay and every realized epoch run the bench factory's trl.SFTTrainer; "
        if args.trainer == "sft"
        else ""
    )
    return (
        f"{model_words(args)}, {str(model_dtype(args)).replace('torch.', '')} on "
        f"{args.device}{', 1 thread' if args.device == 'cpu' else ''}; {trainer}"
        f"{examples.lengths.size} real chitchat lengths capped at {args.cap}; micro "
        f"{args.micro_batch_size} × grad_accum {args.grad_accum}; {args.repeats} rounds of one "
        f"epoch each (transformers.Trainer train_runtime); load "
        f"{load[0]:.2f} → {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s."
    )


def main() -> int:
    args = parse_args()
    for path in (args.lengths, args.recommendation):
        if not path.is_file():
            print(f"{path}: no such file; run `snakemake --cores 2 bucket_sweep` first, or pass it")
            return 2

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)
    started = time.perf_counter()
    load = os.getloadavg()
    examples = load_subset(args.lengths, args.examples, args.cap, args.seed)
    rec = subset_recommendation(json.loads(args.recommendation.read_text()), examples)
    print(data_line(examples, args, load), flush=True)
    document, estimates, runs, skipped = promise_and_realize(examples, rec, args)
    rows = table_rows(document, estimates, runs)
    text = markdown(rows, table_header(examples, args, load, started))
    if skipped:
        text += "\nNot run: " + "; ".join(skipped) + "\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
