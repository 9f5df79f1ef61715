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
3. **Priced beside the table** (``--trainer sft``, bench/realized_beside.py): the installed
   ``optim`` alternatives and, where ``--changes`` names them, ``torch_compile`` and
   ``torch_compile_pad_to_multiple_of_64`` (the replay's compile pricing turned on: a cold CPU
   compile takes minutes a graph). The promise is the replay's own record (its estimates'
   provenance "optim" / "compile"); realized by the factory's trainer with ``optim=`` or
   ``torch_compile=True`` (and ``pad_to_multiple_of``), each compiled epoch from empty compile
   caches, its compile inside ``train_runtime``.

``--changes a,b`` realizes only those changes (and the baseline). Prints the table (change |
promised [95% CI] | realized [95% CI] | verdict | within ±5 pp | inside CI) and,
to say why they differ, each configuration's replayed and realized epoch seconds and the Trainer's
extra seconds per optimizer step. ``--out`` also writes the table as markdown. No timing is
asserted.

    python bench/realized_vs_promised.py --lengths results/padding/lengths.parquet \
        --recommendation results/bucket/recommendation.json [--quick] [--out table.md] \
        [--device cuda --architecture resources/model/gemma-3-270m]
    python bench/realized_vs_promised.py --trainer sft \
        --changes torch_compile,torch_compile_pad_to_multiple_of_64,optim_adamw_torch
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

from realized_beside import (  # noqa: E402
    beside_changes,
    compile_line,
    compile_seconds,
    prices_compile,
    selected,
)
from realized_epochs import rounds, run_realized  # noqa: E402
from realized_lockstep import rounds_until_narrow  # noqa: E402
from realized_setup import (  # noqa: E402
    IGNORE_INDEX,
    Examples,
    build_model,
    load_subset,
    model_dtype,
    model_words,
    parse_args,
    subset_recommendation,
    training_section,
    vocab_size,
)
from realized_table import TOLERANCE_PP, markdown, table_rows, too_wide_changes  # noqa: E402
from trainer_harness import LEARNING_RATE  # noqa: E402

from probes.apply.document import order_changes, recommendations_document  # noqa: E402
from probes.batching import plans as pl  # noqa: E402
from probes.contracts import STAGE_OUTPUTS  # noqa: E402
from probes.report.sections.replay import change_measurement  # noqa: E402

HARNESS = REPO / "bench" / "trainer_harness.py"
FACTORY = f"{REPO / 'bench' / 'sft_factory.py'}:build_trainer"  # --trainer sft


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


def write_gate(work: Path, model_dir: Path, args: argparse.Namespace) -> None:
    """gate.json for the replay: the workflow's own mask gate on the bench model (about 2 s),
    so packing and the padding-free changes are raced where the gate keeps documents apart
    (transformers gives sdpa and eager a block-diagonal mask from the restarting position_ids).

    In a forked child, as the workflow runs it in its own rule: the gate's heap setting
    (probes.mask.memory) leaves glibc's thresholds fixed at 128 KiB in the process it ran in,
    and the replay and the realized trainers (forked from this process) then paid page faults
    on every large block. Run here, a 4 x 256 micro-batch took 12,000 faults against 2,000 and
    the replay promised micro_batch_size_4 at -17% where, without it, it promised -2%. On CUDA
    in this process: the gate confirms on the GPU, a CUDA context does not survive a fork, and
    the steps' blocks are the GPU's."""
    from probes.forked import forked

    if args.device != "cpu":
        gate = gate_json(model_dir, args)
    else:
        with forked(gate_json, (model_dir, args), what="the mask gate", timeout=600) as done:
            gate = done()
    if not gate["passed"]:
        raise SystemExit(f"the mask gate failed on the bench model: {gate['violations'][:1]}")
    (work / "gate.json").write_text(json.dumps(gate, default=str))


def gate_json(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from probes.config import load_config
    from probes.mask.gate import run_gate

    cfg = load_config()
    source = str(model_dir / "config.json")
    training = {**cfg["training"], **training_section(args)}
    _, gate, _ = run_gate(json.loads(Path(source).read_text()), cfg["mask"], training, source)
    return json.loads(json.dumps(gate, default=str))  # plain values, to pickle back


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
    write_gate(work, model_dir, args)
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
    # the race times every change to +-5 pp (the bench's tolerance), not the workflow's 20 pp
    # width that only decides faster or slower: a promise is judged against its point
    cfg["replay"]["max_width"] = 2 * TOLERANCE_PP / 100
    cfg["replay"]["reference_every"] = args.reference_every
    cfg["replay"]["step_changes"] = args.trainer == "sft"
    cfg["replay"]["compile"] = prices_compile(args.changes)  # priced beside its table
    if args.trainer == "sft":  # the promise is the SFTTrainer's own step (probes.step.trainer)
        cfg["trainer"] = {"factory": FACTORY}
    summary = run_replay(inputs, outputs, WorkflowConfig.from_dict(cfg), model_dir, progress=False)
    estimates = pd.read_parquet(outputs["estimates"])
    provenance = pq_metadata(outputs["estimates"])
    summary["step_changes"] = provenance.get("step_changes", [])
    summary["beside"] = {key: provenance.get(key) or {} for key in ("compile", "optim")}
    summary["not_measured"] = provenance.get("not_measured") or {}
    return estimates, plans, summary


def pq_metadata(path: Path) -> dict[str, Any]:
    from probes.io import read_provenance

    return read_provenance(path)


def promised_changes(
    rec: dict[str, Any],
    args: argparse.Namespace,
    examples: pl.PlanExamples,
    estimates,
    step_changes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """recommendations.json for the subset, with the replay's measured saving per change; the
    run's checkpointing read from the replay's step-level changes as the report stage reads it
    (off where they were not priced: the bench's harness and factory train without it)."""
    from probes.apply.changes import run_checkpointing

    no_loss = int((examples.loss_tokens == 0).sum())
    checkpointing = run_checkpointing(step_changes)
    training = {
        **training_section(args),
        "gradient_checkpointing": False if checkpointing is None else checkpointing,
    }
    document = recommendations_document(rec, training, no_loss_examples=no_loss)
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


def epoch_trainer(settings: dict[str, Any], stack: contextlib.ExitStack) -> Any:
    """The bench factory's SFTTrainer built with `settings` (``--trainer sft``) for one epoch,
    its output directory on `stack`; a compiled one (``torch_compile``) from empty compile
    caches, its compile in the epoch."""
    from probes.step.compile import fresh_compiles
    from probes.step.factory import build_trainer, load_factory

    if settings.get("torch_compile"):
        stack.enter_context(fresh_compiles())
    out = stack.enter_context(tempfile.TemporaryDirectory())
    return build_trainer(load_factory(FACTORY), {**settings, "output_dir": out})


def run_trainer_epoch(settings: dict[str, Any]) -> dict[str, float]:
    """One epoch of the bench factory's SFTTrainer built with `settings`, timed by the Trainer."""
    with contextlib.ExitStack() as stack:
        trainer = epoch_trainer(settings, stack)
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def run_realized_trainer(
    changes: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """The baseline and every change as the factory builds it with the change's settings: on
    CPU in lockstep (one process each, taking turns step by step: drift shared), on CUDA epoch
    after epoch in a new order each round (a CUDA context does not survive a fork)."""
    configs = [(pl.BASELINE, {})] + [(c["id"], change_settings(c)) for c in changes]
    run_trainer_epoch({})  # untimed: the process's first trainer pays one-time costs
    if args.device == "cpu":
        return rounds_until_narrow(
            configs, lambda _, s, stack: epoch_trainer(s, stack), args.repeats,
            too_wide_changes, args.extra_rounds,
        )  # fmt: skip
    return rounds(configs, lambda _, settings: run_trainer_epoch(settings), args)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


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
        document = promised_changes(rec, args, examples, estimates, summary.get("step_changes"))
        unpriced: list[str] = []
        if args.trainer == "sft":
            document["changes"] += step_level_changes(estimates, summary["step_changes"])
            beside, unpriced = beside_changes(summary["beside"])
            document["changes"] += beside
            unpriced += compile_line(args)
            unpriced += [f"{name}: {why}" for name, why in summary["not_measured"].items()]
        runnable, skipped = trainer_changes(document)
        changes, left_out = selected(runnable, args.changes)
        skipped += left_out + unpriced
        if args.trainer == "sft":
            runs = run_realized_trainer(changes, args)
        else:
            data = Examples.from_plan(examples, args.seed, vocab_size(args))
            base_kwargs = document["baseline"]["training_arguments"]
            runs = run_realized(changes, base_kwargs, data, args)
    return document, estimates, runs, skipped


def extra_words(args: argparse.Namespace) -> str:
    if args.trainer != "sft" or args.device != "cpu" or not args.extra_rounds:
        return ""
    return f" (up to {args.extra_rounds} more for a change whose realized interval is over 10 pp)"


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
        f"epoch each{extra_words(args)} (transformers.Trainer train_runtime); load "
        f"{load[0]:.2f} → {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s."
    )


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
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
    seconds = compile_seconds(document["changes"], runs)
    if seconds:
        text += "\nCompile in seconds (before each side divides by its own epoch):\n"
        text += "\n".join(seconds) + "\n"
    if skipped:
        text += "\nNot run: " + "; ".join(skipped) + "\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
