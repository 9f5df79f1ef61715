"""The replay's step-level changes (probes.step.changes): which to price against the loaded
step, their plan rows beside the device's plans, and what this device cannot measure."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from probes.batching import plans as pl
from probes.io import read_json, read_provenance
from probes.settings import TrainingConfig

if TYPE_CHECKING:
    from probes.replay.prepare import StageSettings

LOG = logging.getLogger("probes.replay")
GPU_ONLY = "GPU only: not measured on this device"
# bench/realized_vs_promised.py --trainer sft (2-core CPU, 1 torch thread): two workers realized
# -5 to -9% (an epoch slower) against a promise of about 0: their start-up and the batches'
# transfer between processes cost more than the collation they take off the step
WORKERS_ON_CPU = (
    "not priced on a CPU run: the workers start each epoch and hand every batch between "
    "processes on the cores the step runs on, which the replay does not time (a 2-core CPU "
    "bench realized -5 to -9% against a promise of about 0); priced on a GPU, where the host's "
    "cores are free"
)


@dataclass(frozen=True)
class StepChanges:
    """The step-level changes the replay prices (probes.step.changes), their plan rows, and
    what is not priced, each with why (this device cannot run it; not a setting of this step)."""

    changes: list[Any]
    plans: pd.DataFrame
    not_measured: dict[str, str]
    # refused before timing, each with why (padding-free where documents would mix)
    invalid: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.changes)


def add_step_changes(
    runner: Any,
    plans: pd.DataFrame,
    inputs: Mapping[str, Any],
    training: TrainingConfig,
    stage: StageSettings,
    cpu_only: bool,
    max_len: int,
) -> StepChanges:
    """The step-level changes to price against the loaded step (set on `runner`), their plan
    rows beside `plans` (the device's plans), and what this device cannot measure."""
    from probes.step import changes as sc

    switch = sc.StepSwitch(runner.runner)
    runner.switch = switch
    if not stage.step_changes:
        return StepChanges([], pd.DataFrame(), {})
    changes = step_changes_for(switch.base, training, cpu_only)
    switch.configs = {c.strategy: c.config for c in changes}
    added = change_plans_for(changes, plans, inputs, training, cpu_only, max_len)
    LOG.info("step-level changes: %s (base %s)", [c.strategy for c in changes], switch.base)
    refused = refused_changes(runner.runner, changes, added, inputs)
    unpriced = {
        **not_measured(runner.runner, cpu_only, switch.base),
        **compile_off(stage, cpu_only),
    }
    return StepChanges(changes, added, unpriced, refused)


def refused_changes(
    step: Any, changes: list[Any], added: pd.DataFrame, inputs: Mapping[str, Any]
) -> dict[str, str]:
    """The padding-free changes that must not be priced, each with why: the mask gate's verdict
    on its attention implementation (gate.json), or the loaded step's own padding-free collator
    letting the documents of a micro-batch see each other."""
    from probes.step import padding_free as pf

    names = [c.strategy for c in changes if pf.is_padding_free(c.strategy)]
    if not names:
        return {}
    gate = inputs.get("gate")
    if gate is None:
        return {name: "the mask gate's gate.json is not an input of this run" for name in names}
    refused = pf.invalid_changes(
        read_json(gate), [pf.implementation_of(n) for n in names], str(gate)
    )
    leak = step_collator_leak(step, added[added["strategy"].isin(names)])
    return {**{name: leak for name in names if leak}, **refused}


def step_collator_leak(step: Any, rows: pd.DataFrame) -> str | None:
    """Why the step's padding-free micro-batches let documents attend to each other, from one
    of them with two or more documents as the step collates it (the trainer's own collator);
    None where it keeps them apart, or the step builds them itself (the harness path)."""
    from probes.step import padding_free as pf

    collate = getattr(step, "collate", None)
    several = rows[rows["n_examples"] >= 2] if len(rows) else rows
    if collate is None or several.empty:
        return None
    row = several.iloc[0]
    return pf.collator_leak(collate([str(i) for i in row["example_ids"]], True))


def not_measured(step: Any, cpu_only: bool, base: Any = None) -> dict[str, str]:
    """What the replay does not price, with why: what this device cannot run, the loss
    kernels the loaded step cannot be set to (probes.step.loss_changes), and a trainer's
    installed ``optim`` alternatives (probes.step.optim), and on a CPU run the dataloader
    workers `base` (the step's config) would be priced with (WORKERS_ON_CPU)."""
    from probes.step import changes as sc
    from probes.step.loss_changes import unpriced_losses
    from probes.step.optim import unpriced_optims

    device_type = "cpu" if cpu_only else "cuda"
    workers = sc.workers_changes(base) if cpu_only and base is not None else []
    return {
        **unpriced_losses(step, device_type),
        **unpriced_optims(getattr(step, "trainer", None)),
        **{name: GPU_ONLY for name in sc.gpu_only(device_type)},
        **{c.strategy: WORKERS_ON_CPU for c in workers},
    }


def step_changes_for(base: Any, training: TrainingConfig, cpu_only: bool = False) -> list[Any]:
    """The step-level changes to price against `base`: on a CPU run without the dataloader
    workers change (WORKERS_ON_CPU)."""
    from probes.step import changes as sc

    changes = sc.step_changes(base, int(training.micro_batch_size), int(training.grad_accum))
    if cpu_only:
        changes = [c for c in changes if not c.strategy.startswith(sc.WORKERS_PREFIX)]
    return changes


def change_plans_for(
    changes: list[Any],
    plans: pd.DataFrame,
    inputs: Mapping[str, Any],
    training: TrainingConfig,
    cpu_only: bool,
    max_len: int,
) -> pd.DataFrame:
    """The plan rows of the step-level changes: the baseline's micro-batches, or the trainer's
    random order at a changed micro-batch size (at the device's lengths: a CPU rehearsal's
    scaled ones)."""
    from probes.step import changes as sc

    examples = pl.read_examples(inputs["lengths"], int(training.max_seq_len))
    if cpu_only:
        examples = pl.rehearsal_examples(examples, max_len, int(training.max_seq_len))
    seed = int(read_provenance(inputs["plans"]).get("plan_seed", 0))
    micro = sc.micro_batch_plans(changes, examples, max_len, seed)
    return sc.change_plans(plans, changes, micro)


# ---------------------------------------------------------------------------------------------
# Priced beside the replay's table, on their own clocks: torch_compile (probes.step.compile) and
# the trainer's optim alternatives (probes.step.optim)
# ---------------------------------------------------------------------------------------------

OPTIM_TURNS = 5  # turns of each optimizer, alternating


def priced_beside(
    runner: Any,
    plans: pd.DataFrame,
    training: TrainingConfig,
    stage: StageSettings,
    table: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """What the replay's provenance carries beside its table: {"compile": compile_record,
    "optim": optim_record} (each {} where it does not apply), compile's saving a share of
    `table`'s baseline epoch estimate. The stage's one call."""
    return {
        "compile": compile_record(runner, plans, training, stage, table),
        "optim": optim_record(runner, plans, training, stage),
    }


def optim_record(
    runner: Any, plans: pd.DataFrame, training: TrainingConfig, stage: StageSettings
) -> dict[str, Any]:
    """Each installed optim alternative against the trainer's own, in alternating turns on the
    baseline's median micro-batch (probes.step.optim.time_optimizers); {} on the harness path
    or where step-level changes are off."""
    from probes.step import optim

    step = runner.runner
    trainer = getattr(step, "trainer", None)
    if trainer is None or not stage.step_changes:
        return {}
    own = optim.current_optim(trainer.args)
    names = [n for n in optim.installed_optims() if n != own]
    if not names:
        return {}
    base = plans[plans["strategy"] == pl.BASELINE].sort_values("computed_tokens")
    batch = runner.device_batch(base.iloc[len(base) // 2])
    try:
        times = optim.time_optimizers(step, batch, names, OPTIM_TURNS)
    except Exception as error:  # a side measurement: the replay's table stands without it
        why = f"not priced: {type(error).__name__} building or stepping an alternative"
        LOG.warning("optim alternatives %s", why)
        return {optim.OPTIM_PREFIX + n: {"optim": n, "against": own, "saving": None,
                                         "memory": why} for n in names}  # fmt: skip
    return optim.price_optims(times, own, int(training.grad_accum))


PAD_MULTIPLE = 64  # the companion: the collator's pad_to_multiple_of (tensor-core friendly)
COMPILE_SHAPES = 4  # shapes compiled and timed per configuration; the rest charged (price)
COMPILE_REPEATS = 3  # eager / compiled pairs per shape
COMPILE_MEMORY = "not predicted: the memory stage's fake tensors do not run compiled graphs"


def compile_off(stage: StageSettings, cpu_only: bool) -> dict[str, str]:
    """torch_compile and its companion listed as not timed, naming the key, where it is off."""
    from probes.step import compile as cp

    if stage.compile:
        return {}
    why = cp.OFF_ON_CPU if cpu_only else f"not timed: {cp.ENABLE_KEY} is false; set it to price it"
    return {cp.COMPILE_STRATEGY: why, f"{cp.PAD_MULTIPLE_PREFIX}{PAD_MULTIPLE}": why}


def compile_record(
    runner: Any,
    plans: pd.DataFrame,
    training: TrainingConfig,
    stage: StageSettings,
    table: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """torch_compile priced on the baseline's plan, and with the collator's pad_to_multiple_of
    (fewer shapes, more padding), each compiled afresh from empty caches
    (probes.step.compile.fresh_compiles), amortized over the run's length (the trainer's
    num_train_epochs / max_steps; one epoch for a harness), as a share of `table`'s baseline
    epoch estimate over that run, a fresh process's first-compile excess included (measured
    first, probes.step.cold.first_compile); {} where replay.compile is off (compile_off)."""
    from probes.step import cold
    from probes.step import compile as cp

    if not stage.compile:
        return {}
    base = plans[plans["strategy"] == pl.BASELINE]
    grad_accum = int(training.grad_accum)
    length = run_length(runner, len(base), grad_accum)
    baseline = run_baseline(table, len(base), length)
    first = cold.first_compile()  # before any compile of the model: the process's first
    out: dict[str, Any] = {}
    name = f"{cp.PAD_MULTIPLE_PREFIX}{PAD_MULTIPLE}"
    for strategy, plan, multiple in (
        (cp.COMPILE_STRATEGY, base, None),
        (name, cp.padded_to_multiple(base, PAD_MULTIPLE), PAD_MULTIPLE),
    ):
        measured = compile_measured(runner, plan, multiple)
        if isinstance(measured, str):
            out[strategy] = {"recommended": False, "why": measured}
            continue
        run, n_shapes, spread = measured
        priced = cp.price(run, n_shapes, length, grad_accum, baseline, first, spread)
        out[strategy] = {**priced, "memory": COMPILE_MEMORY}
    LOG.info("torch_compile priced: %s", {k: v.get("saving") for k, v in out.items()})
    return out


def run_length(runner: Any, plan_micro_batches: int, grad_accum: int) -> int:
    """Micro-batches of the user's run: the trainer's num_train_epochs / max_steps."""
    from probes.step import compile as cp

    args = getattr(getattr(runner.runner, "trainer", None), "args", None)
    epochs = float(getattr(args, "num_train_epochs", 1.0))
    return cp.run_micro_batches(
        plan_micro_batches, grad_accum, epochs, int(getattr(args, "max_steps", -1))
    )


def run_baseline(table: pd.DataFrame | None, plan_micro_batches: int, length: int) -> Any:
    """The table's baseline epoch estimate with its interval over the run (RunBaseline); None
    (the eager micro-batches instead, said in the record) where the table has none."""
    from probes.step import compile as cp

    if table is None or "strategy" not in table:
        return None
    row = table[table["strategy"] == pl.BASELINE]
    columns = ("estimated_time_s", "ci_low_s", "ci_high_s")
    if row.empty or not all(col in row for col in columns):
        return None
    epoch = tuple(float(row.iloc[0][col]) for col in columns)
    if not all(v == v and v > 0 for v in epoch):  # NaN or not positive: not estimated
        return None
    return cp.RunBaseline.of_epoch(epoch, plan_micro_batches, length)


COLD_AGAIN_MAX_S = 20.0  # a second cold compile of the first shape where the first took less


def compile_measured(runner: Any, plan: pd.DataFrame, multiple: int | None) -> Any:
    """(run, shapes of the plan, (spread, where from)) of one configuration compiled from empty
    caches; where its first shape compiled within COLD_AGAIN_MAX_S, that shape compiled once
    more from empty caches for the compile's own spread (else the documented floor); or why it
    was not timed (the trainer's collator cannot pad to `multiple`)."""
    from probes.step import cold
    from probes.step import compile as cp

    with collator_padding(runner.runner, multiple) as why:
        if why:
            return why
        shapes = cp.first_rows(plan, pl.BASELINE)
        batches = [(shape, runner.device_batch(row)) for shape, row in shapes[:COMPILE_SHAPES]]
        with cp.fresh_compiles():  # each configuration pays its own compiles
            eager, compiled = cp.step_functions(runner.runner)
            run = cp.measure(eager, compiled, batches, COMPILE_REPEATS)
        spread = (cold.COMPILE_SPREAD, cold.SPREAD_FLOOR)
        if run.shapes and run.error is None and run.shapes[0].compile_s <= COLD_AGAIN_MAX_S:
            with cp.fresh_compiles():
                compiled = cp.step_functions(runner.runner)[1]
                again = cp.compile_again(compiled, run.shapes[0], batches[0][1])
            spread = cold.spread_with(run.shapes[0].compile_s, again)
    return run, len(shapes), spread


@contextmanager
def collator_padding(step: Any, multiple: int | None) -> Iterator[str | None]:
    """The trainer's collator padding to `multiple` for the body (None: as it is); yields why
    not where its collator has no pad_to_multiple_of (the harness path builds every
    micro-batch at its plan row's own padded length, which padded_to_multiple rounded)."""
    collator = getattr(step, "collator", None)
    if multiple is None or collator is None:
        yield None
        return
    if not hasattr(collator, "pad_to_multiple_of"):
        name = type(collator).__name__
        yield f"not timed: the trainer's collator ({name}) has no pad_to_multiple_of"
        return
    before = collator.pad_to_multiple_of
    collator.pad_to_multiple_of = multiple
    try:
        yield None
    finally:
        collator.pad_to_multiple_of = before
