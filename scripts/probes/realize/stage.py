"""The realize stage: real training steps of the baseline and the replay's top changes, and the
realized saving beside the promised one.

Order of work: the replay's per-strategy table -> the changes to check (the best measured
savings, recommended ones first, at most ``realize.max_changes``; ``cpu_max_changes`` on CPU)
-> the replay's own plans (rehearsed on CPU at the replay's scaled lengths) -> idle-card check
-> weights and the user's harness (the replay's loader) -> a simple random sample of each
strategy's optimizer steps, each run whole (probes.realize.steps), interleaved across strategies
(probes.realize.timing) -> epoch estimates with intervals (probes.realize.sample) -> the
promised-vs-realized table and its verdicts (probes.realize.estimate, probes.realize.verdict)
-> outputs, all or nothing.

``realize.enabled: false``, or a replay without a baseline, writes a not-run note instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from probes.contracts import PAD_TO_MAX_SEQ_LEN, RANDOM, STAGE_OUTPUTS, check_table_columns
from probes.errors import ControlFailedError, ProbeError
from probes.io import read_parquet, run_metadata
from probes.realize import verdict as vd
from probes.realize.control import CONTROL_NAME, run_control
from probes.realize.estimate import REALIZED_COLUMNS, realized_table
from probes.realize.promise import step_promises
from probes.realize.scope import never_checked
from probes.realize.steps import StepTimer
from probes.realize.timing import STEP_COLUMNS, measure
from probes.settings import RealizeConfig, TrainingConfig, WorkflowConfig
from probes.stage import all_or_nothing
from probes.step.idle import check_idle_card
from probes.step.threads import timing_threads

LOG = logging.getLogger("probes.realize")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["realize"])
INPUT_KEYS = ("estimates", "units", "plans", "lengths", "recommendation")
NOT_RUN, RAN = "not_run", "ran"


class RealizeError(ProbeError, RuntimeError):
    """The stage cannot run as configured; nothing was written."""


# ---------------------------------------------------------------------------------------------
# What to check
# ---------------------------------------------------------------------------------------------


def select_changes(estimates: pd.DataFrame, max_changes: int) -> list[str]:
    """The changes to check, best first: the valid strategies (not the baseline, not the
    inverted pad_to_max_seq_len row) with the largest measured saving, a saving above 0. Those
    the Summary recommends (interval above 0) come first; with none, the best measured ones are
    still checked, so an interval too wide to recommend is confronted with real steps. Never
    those realize cannot check (probes.realize.scope: the dataloader workers)."""
    rows = estimates[
        estimates["valid"].fillna(False).astype(bool)
        & ~estimates["strategy"].isin([RANDOM, PAD_TO_MAX_SEQ_LEN])
        & estimates["strategy"].map(lambda s: never_checked(str(s)) is None).astype(bool)
        & (pd.to_numeric(estimates["saving_vs_random"], errors="coerce") > 0)
    ].copy()
    rows["_recommended"] = pd.to_numeric(rows["saving_ci_low"], errors="coerce") > 0
    rows = rows.sort_values(["_recommended", "saving_vs_random"], ascending=False, kind="stable")
    return [str(s) for s in rows["strategy"].head(max(int(max_changes), 0))]


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def write_not_run(outputs: Mapping[str, str | Path], reason: str, cfg: WorkflowConfig) -> None:
    meta = run_metadata(dict(cfg.raw))  # the whole config as a dict: the provenance hashes it
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("realized", pd.DataFrame(columns=list(REALIZED_COLUMNS)), meta)
        out.parquet("steps", pd.DataFrame(columns=list(STEP_COLUMNS)), meta)
        out.json("summary", {"status": NOT_RUN, "reason": reason})
        out.json("control", {"status": NOT_RUN, "reason": reason, "name": CONTROL_NAME})


def read_replay_table(path: str | Path, table: str) -> pd.DataFrame:
    """One of the replay's tables, its columns checked; a missing file named with its rule."""
    if not Path(path).is_file():
        raise RealizeError(f"{path}: no such file; it is written by the replay rule.")
    frame = read_parquet(path)
    check_table_columns(frame.columns, table, path)
    return frame


def read_estimates(path: str | Path) -> pd.DataFrame:
    return read_replay_table(path, "replay_estimates")


def read_units(path: str | Path) -> pd.DataFrame:
    """The replay's timed units (its micro-batches, optimizer steps and fit points)."""
    return read_replay_table(path, "replay_steps")


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_realize(inputs, outputs, cfg, Path(inputs["tokenizer"][0]).parent)
    LOG.info("realize summary: %s", summary)


def load_real_runner(
    model_path: str | Path, cfg: WorkflowConfig, device: torch.device, max_length: int
) -> tuple[Any, int, int, dict[str, Any], str, str]:
    """The replay's step (the user's trainer, or the harness on the real model), its dtype."""
    from probes.replay.prepare import replay_dtype
    from probes.step.load import load_step

    dtype, reason = replay_dtype(cfg.profile.dtype, device)
    runner, vocab, pad_id, step = load_step(cfg, model_path, device, dtype, max_length)
    return runner, vocab, pad_id, step, str(dtype).replace("torch.", ""), reason


def with_step_change_plans(
    plans: pd.DataFrame,
    changes: Sequence[str],
    inputs: Mapping[str, Any],
    training: TrainingConfig,
    cpu_only: bool,
    max_len: int,
) -> pd.DataFrame:
    """The device's plans with the rows of the step-level changes among `changes` (the replay's
    own builder: probes.replay.step_changes.change_plans_for)."""
    from probes.replay.combined import plans_at_shape
    from probes.replay.step_changes import change_plans_for
    from probes.step import changes as sc
    from probes.step import combined as cb

    micro, accum = int(training.micro_batch_size), int(training.grad_accum)
    shapes = sc.plan_shapes(changes, micro, accum)
    added = [change_plans_for(shapes, plans, inputs, training, cpu_only, max_len)] if shapes else []
    for name in filter(cb.is_combined, changes):
        shape = cb.micro_shape(sc.plan_shapes(cb.parse(name).steps, micro, accum), micro, accum)
        at = {shape: plans_at_shape(inputs, training, max_len if cpu_only else None, shape)}
        added.append(cb.combined_plan(cb.parse(name), plans, at, shape, (micro, accum)))
    return pd.concat([plans, *added], ignore_index=True) if added else plans


def step_switch(runner: Any, changes: Sequence[str], training: TrainingConfig) -> Any:
    """The loaded step set per strategy: each step-level change the replay priced, by name."""
    from probes.replay.step_changes import step_changes_for
    from probes.step import changes as sc
    from probes.step import combined as cb

    parts = {n: cb.parse(n).steps if cb.is_combined(n) else (n,) for n in changes}
    wanted = {n: p for n, p in parts.items() if any(sc.is_step_change(s) for s in p)}
    if not wanted:
        return None
    switch = sc.StepSwitch(runner)
    known = {c.strategy: c for c in step_changes_for(switch.base, training)}
    missing = sorted({s for p in wanted.values() for s in p} - set(known))
    if missing:
        raise RealizeError(
            f"realize: the replay priced {missing} against another base step than the one "
            f"loaded now ({switch.base}); rerun replay and realize together"
        )
    switch.configs = {
        name: cb.merged_config(switch.base, [known[s] for s in steps])
        for name, steps in wanted.items()
    }
    return switch


def device_plans(
    inputs: Mapping[str, Any], cfg: WorkflowConfig, changes: Sequence[str], cpu_only: bool
) -> tuple[pd.DataFrame, int]:
    """The replay's plans on this device, the step-level changes' among them; every change
    the replay ranks must have one."""
    from probes.replay.prepare import plans_for_device

    training = cfg.training
    plans, max_len = plans_for_device(inputs, training, cpu_only, int(cfg.replay.cpu.max_seq_len))
    plans = with_step_change_plans(plans, changes, inputs, training, cpu_only, max_len)
    unknown = sorted(set(changes) - set(plans["strategy"]))
    if unknown:
        raise RealizeError(
            f"{inputs['plans']}: no plan for {unknown} that {inputs['estimates']} ranks; rerun "
            "bucket_sweep and replay together"
        )
    return plans, max_len


def control_first(
    plans: pd.DataFrame,
    strategies: Sequence[str],
    settings: RealizeConfig,
    grad_accum: int,
    units: pd.DataFrame | None,
) -> dict[str, Any]:
    """The positive control: no wall time, and a broken estimator must not cost a GPU run
    (`units`: the replay's timed micro-batches, whose shapes its promise is refitted on)."""
    control = run_control(
        plans,
        strategies,
        settings.control_steps,
        settings.seed,
        int(grad_accum),
        settings.control_tolerance,
        units,
    )
    LOG.info("control %s", "passed" if control["passed"] else "FAILED")
    if not control["passed"]:
        raise ControlFailedError(
            f"realize: positive control failed, no output written: {control['observed']}"
        )
    return control


def realize_summary(
    table: pd.DataFrame,
    steps: pd.DataFrame,
    changes: Sequence[str],
    settings: RealizeConfig,
    cpu_only: bool,
    sample_size: int,
    budget_s: float,
) -> dict[str, Any]:
    """summary.json: each change's verdict and how many steps were sampled."""
    verdicts = {
        str(r.strategy): str(r.verdict) for r in table.itertuples() if r.role == vd.CHANGE_ROLE
    }
    return {
        "status": RAN,
        "verdicts": verdicts,
        "changes": list(changes),
        "cpu_only": cpu_only,
        "sample_steps": int(steps.groupby("strategy").size().max()),
        "first_sample_steps": sample_size,
        "budget_s": budget_s,
        "warmup": settings.warmup,
        "agree_within": settings.agree_within,
    }


@dataclass
class RealizeWork:
    """What the stage checks, known before any timing: the device, the changes, the replay's
    plans on this device (rehearsed on CPU) with its per-step promise, and the sample's size."""

    device: torch.device
    cpu_only: bool
    changes: list[str]
    plans: pd.DataFrame
    max_len: int
    promises: pd.Series | None
    units: pd.DataFrame  # the replay's timed units, the promise's fit (the control refits it)
    sample_size: int
    budget_s: float

    @property
    def strategies(self) -> list[str]:
        return [RANDOM, *self.changes]


def plan_work(
    inputs: Mapping[str, Any], cfg: WorkflowConfig, estimates: pd.DataFrame
) -> RealizeWork:
    """The changes to check on this device, the plans they run and the replay's promise."""
    from probes.step.runner import resolve_device

    profile, settings = cfg.profile, cfg.realize
    device = resolve_device(profile.device, profile.allow_cpu)
    cpu_only = device.type != "cuda"
    changes = select_changes(
        estimates, settings.cpu_max_changes if cpu_only else settings.max_changes
    )
    plans, max_len = device_plans(inputs, cfg, changes, cpu_only)
    units = read_units(inputs["units"])
    work = RealizeWork(
        device=device,
        cpu_only=cpu_only,
        changes=changes,
        plans=plans,
        max_len=max_len,
        promises=step_promises(plans, units),
        units=units,
        sample_size=settings.cpu_sample_steps if cpu_only else settings.sample_steps,
        budget_s=settings.cpu_budget_s if cpu_only else 0.0,
    )
    LOG.info(
        "realize on %s: baseline + %s, %d sampled optimizer steps each",
        device,
        changes or "no change (none measured faster)",
        work.sample_size,
    )
    return work


def load_timer(
    load: Callable[..., tuple],
    model_path: str | Path,
    cfg: WorkflowConfig,
    work: RealizeWork,
) -> tuple[StepTimer, dict[str, Any], tuple[str, str]]:
    """The step through `load` (seeded, CPU threads set), its timer switched per step-level
    change: (timer, harness description, (dtype name, why))."""
    seed = cfg.realize.seed
    if work.cpu_only:
        torch.set_num_threads(timing_threads(cfg.replay.cpu.threads))
    torch.manual_seed(seed)
    runner, vocab, pad_id, harness, dtype, dtype_reason, *clock = load(
        model_path, cfg, work.device, work.max_len
    )
    timer = StepTimer(runner, vocab, pad_id, seed, *clock)
    timer.switch = step_switch(runner, work.changes, cfg.training)
    return timer, harness, (dtype, dtype_reason)


def time_steps(timer: StepTimer, work: RealizeWork, settings: RealizeConfig) -> pd.DataFrame:
    """The sampled steps, timed (probes.realize.timing.measure), each beside its promise."""
    strategies = work.strategies
    steps = measure(
        timer, work.plans, strategies, work.sample_size, settings.warmup, settings.seed,
        work.budget_s,
    )  # fmt: skip
    promised = work.promises if work.promises is not None else pd.Series(dtype=float)
    steps["promised_micro_batch_s"] = [
        float(promised.get((s, i), math.nan))
        for s, i in zip(steps["strategy"], steps["optimizer_step_index"], strict=True)
    ]
    return steps


def realize_provenance(
    cfg: WorkflowConfig,
    work: RealizeWork,
    dtype: tuple[str, str],
    harness: dict[str, Any],
    idle: Any,
    started: float,
) -> dict[str, Any]:
    """What the realize ran, on what (each table's metadata)."""
    from probes.profile.evidence import timed_run_provenance

    return timed_run_provenance(
        cfg, work.device, work.cpu_only, dtype, work.max_len, harness, idle, started
    )


def run_realize(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str | Path],
    cfg: WorkflowConfig,
    model_path: str | Path,
    load: Callable[..., tuple] = load_real_runner,
    card_probe: Callable[[int], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run the stage and write every output, or none. `load(model_path, cfg, device, max_len)`
    (`cfg` the WorkflowConfig) returns (StepRunner, vocab_size, pad_id, harness description,
    dtype name, dtype reason) and may add a seventh item, the clock the steps are timed with
    (default perf_counter)."""
    missing = [k for k in OUTPUT_KEYS if k not in outputs] + [
        k for k in INPUT_KEYS if k not in inputs
    ]
    if missing:
        raise RealizeError(f"realize: missing path(s) for {missing}")
    settings = cfg.realize
    if not settings.enabled:
        write_not_run(outputs, "realize.enabled is false", cfg)
        return {"status": NOT_RUN}
    estimates = read_estimates(inputs["estimates"])
    if estimates.empty or RANDOM not in set(estimates["strategy"]):
        reason = f"{inputs['estimates']}: the replay measured no '{RANDOM}' baseline"
        write_not_run(outputs, reason, cfg)
        return {"status": NOT_RUN, "reason": reason}
    started = time.perf_counter()
    work = plan_work(inputs, cfg, estimates)
    # the positive control first: no wall time, and a broken estimator must not cost a GPU run
    control = control_first(
        work.plans, work.strategies, settings, cfg.training.grad_accum, work.units
    )
    idle = check_idle_card(cfg.profile.idle, work.device, card_probe, sleep)
    timer, harness, dtype = load_timer(load, model_path, cfg, work)
    steps = time_steps(timer, work, settings)
    table = realized_table(
        steps, estimates, work.plans, work.changes, settings.agree_within, work.cpu_only,
        work.max_len, work.promises,
    )  # fmt: skip
    provenance = realize_provenance(cfg, work, dtype, harness, idle, started)
    summary = realize_summary(
        table, steps, work.changes, settings, work.cpu_only, work.sample_size, work.budget_s
    )
    summary["wall_s"] = provenance["wall_s"]
    observed = {**control["observed"], "cpu_only": work.cpu_only}
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("realized", table, provenance)
        out.parquet("steps", steps, provenance)
        out.json("summary", summary)
        out.json("control", {**control, "observed": observed})
    return summary
