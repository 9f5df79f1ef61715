"""The replay stage: measured epoch time of every change (batching and step-level), with
intervals.

Order of work (``run_replay``): the device, plans and settings (probes.replay.prepare) ->
positive control (the step of known cost, cheap, fails fast) -> idle-card check -> the user's
step with its step-level changes -> scaling fit over the data's own lengths and the instrument's
CV -> the changes the budget can decide, raced (probes.replay.sequential.race) -> the combined
configuration, raced beside the baseline (probes.replay.combined) -> coverage control
(probes.replay.coverage) -> outputs (probes.replay.outputs; written all-or-nothing).

On CPU (no GPU, profile.allow_cpu) the plans are rebuilt with every length scaled by
``replay.cpu.max_seq_len`` / ``training.max_seq_len`` (a rehearsal of the data's shape), so the
run stays within a few minutes; every output says ``cpu_only`` and its numbers are not
comparable with a GPU run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching import plans as pl
from probes.contracts import STAGE_OUTPUTS
from probes.errors import ControlFailedError
from probes.replay.combined import all_steps, time_combined, with_combined
from probes.replay.control import run_synthetic_control
from probes.replay.coverage import coverage_control
from probes.replay.estimate import FitPricing, fit_priced_time
from probes.replay.outputs import (
    completed_control,
    fit_table_row,
    price,
    replay_provenance,
    replay_summary,
    steps_table,
)
from probes.replay.prepare import (
    ReplayError,
    ReplayPlan,
    invalid_strategies,
    prepare,
    replay_dtype,
)
from probes.replay.reference import REFERENCE_RULE, Reference
from probes.replay.sequential import plans_table, race
from probes.replay.step_changes import StepChanges, add_step_changes, priced_beside
from probes.replay.strata import MIN_SIZED_STRATA, affordable_changes
from probes.replay.timing import (
    ReplayRunner,
    instrument_unit,
    measure_fit,
    measure_instrument,
    median_row,
)
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step.idle import check_idle_card
from probes.step.load import load_step
from probes.step.threads import timing_threads

LOG = logging.getLogger("probes.replay")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["replay"])


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_replay(inputs, outputs, cfg, Path(inputs["tokenizer"][0]).parent)
    LOG.info("replay summary: %s", summary)


def load_replay_step(
    plan: ReplayPlan, cfg: WorkflowConfig, inputs: Mapping[str, Any], model_path: str | Path
) -> tuple[ReplayRunner, StepChanges, tuple[torch.dtype, str], dict[str, Any]]:
    """The step (the user's trainer or harness) in the profiled dtype, its step-level changes
    added to the plans."""
    stage = plan.stage
    if plan.cpu_only:
        torch.set_num_threads(timing_threads(stage.threads))
    torch.manual_seed(plan.settings.seed)
    dtype = replay_dtype(cfg.profile.dtype, plan.device)
    step, vocab_size, pad_id, described = load_step(
        cfg, model_path, plan.device, dtype[0], plan.max_len if plan.cpu_only else None,
        plan.settings.seed,
    )  # fmt: skip
    runner = ReplayRunner(step, vocab_size, pad_id, plan.settings.seed, stage.repeats)
    changes = add_step_changes(
        runner, plan.plans, inputs, cfg.training, stage, plan.cpu_only, plan.max_len
    )
    if changes:
        plan.plans = pd.concat([plan.plans, changes.plans], ignore_index=True)
    return runner, changes, dtype, described


def measure_model(
    runner: ReplayRunner, plan: ReplayPlan, cfg: WorkflowConfig
) -> tuple[Any, pd.DataFrame, float, dict[str, Any]]:
    """The scaling fit over the data's own lengths and the instrument's own spread on random's
    median micro-batch (the model is warm from the fit): (fit, its points, loss share,
    instrument)."""
    stage, settings = plan.stage, plan.settings
    random_plan = plan.plans[plan.plans["strategy"] == pl.BASELINE]
    loss_share = float(random_plan["loss_tokens"].sum()) / float(random_plan["real_tokens"].sum())
    if cfg.training.loss_on == "all":
        loss_share = 1.0
    fit, fit_points = measure_fit(
        runner, plan.fit_lengths, plan.micro, loss_share, stage.fit_repeats, settings.seed,
        settings.bootstrap_resamples,
    )  # fmt: skip
    LOG.info("fit %s: a=%.3g b=%.3g c=%.3g", fit.fit.method, fit.fit.a, fit.fit.b, fit.fit.c)
    reference = median_row(plan.plans, pl.BASELINE)
    instrument = measure_instrument(
        runner, reference, stage.instrument_repeats, max(settings.warmup, 1)
    )
    LOG.info("instrument CV %.3f over %d identical micro-batches", instrument["cv"],
             instrument["repeats"])  # fmt: skip
    if stage.reference_every > 0 and instrument["mean_s"] > 0:
        runner.reference = Reference(reference, float(instrument["mean_s"]), stage.reference_every)
        instrument["reference"] = REFERENCE_RULE.format(every=stage.reference_every)
    return fit, fit_points, loss_share, instrument


def instrument_noise(
    instrument: Mapping[str, Any], runner: ReplayRunner
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The instrument's CV (0 where it could not time) with its degrees of freedom, and the
    unit the planning prices (timing.instrument_unit) with its share of the reference timings
    beside it where units are priced against one."""
    cv = instrument["cv"] if math.isfinite(instrument["cv"]) else 0.0
    unit = instrument_unit(instrument)
    if runner.reference is not None:
        unit = (unit[0] + runner.reference.mean_s / runner.reference.every, unit[1])
    return (cv, max(instrument["repeats"] - 1.0, 1.0)), unit


def plans_to_time(
    plan: ReplayPlan,
    invalid: dict[str, str],
    measured: tuple[tuple[float, float], float, float],
    pricing: FitPricing,
    enabled: bool,
) -> pd.DataFrame:
    """The plans of the changes the budget can decide (strata.affordable_changes; `measured`:
    the instrument's unit, its CV and the budget), the most promising by the scaling fit over
    their exact shapes first; the invalid ones beside them as before; each change left out is
    added to `invalid` with its reason."""
    names = list(dict.fromkeys(plan.plans["strategy"]))
    if not enabled:
        return plan.plans
    unit, cv, budget_s = measured
    settings = plan.settings
    candidates = plan.plans[~plan.plans["strategy"].isin(list(invalid))]
    timed, not_timed = affordable_changes(
        candidates, unit, cv, settings.max_width, budget_s,
        MIN_SIZED_STRATA * settings.samples_per_stratum, pl.BASELINE,
        fit_savings(candidates, pricing), fit_unit_seconds(candidates, pricing),
    )  # fmt: skip
    for name, why in not_timed.items():
        LOG.info("%s %s", name, why)
    invalid.update(not_timed)
    keep = set(timed) | {n for n in names if n in invalid and n not in not_timed}
    return plan.plans[plan.plans["strategy"].isin(keep)]


def fit_savings(plans: pd.DataFrame, pricing: FitPricing) -> dict[str, float]:
    """Each strategy's saving the scaling fit predicts from its plan's exact shapes (NaN where
    the fit cannot price it: a shape outside its measured range, more rows than it timed)."""
    steps = {n: int(g["optimizer_step_index"].nunique()) for n, g in plans.groupby("strategy")}
    times = {
        n: fit_priced_time(g, pricing, 0.0, steps[n])[0]
        for n, g in plans.groupby("strategy", sort=False)
    }
    base = times.get(pl.BASELINE, math.nan)
    return {n: 1.0 - t / base if base > 0 else math.nan for n, t in times.items()}


def fit_unit_seconds(plans: pd.DataFrame, pricing: FitPricing) -> dict[str, float]:
    """Each strategy's mean micro-batch seconds by the scaling fit's fixed and per-token terms
    (c + b·tokens/rows over its plan): what planning prices a unit at."""
    fit = pricing.fit
    if not (fit.c > 0 and fit.b > 0):
        return {}
    return {
        n: float(fit.c + fit.b * g["computed_tokens"].mean() / max(pricing.rows, 1))
        for n, g in plans.groupby("strategy", sort=False)
    }


def time_plans(
    runner: ReplayRunner,
    plan: ReplayPlan,
    invalid: dict[str, str],
    cv: tuple[float, float],
    unit: tuple[float, float],
    pricing: FitPricing,
    progress: bool,
    spent_s: float = 0.0,
) -> tuple[Any, Any]:
    """The sequential design over the valid strategies the budget can decide (the others are
    added to `invalid`, each with what deciding it would take: strata.affordable_changes):
    (design, result); its strata as many as the budget affords the first round."""
    stage = plan.stage
    # the budget is the stage's: what loading, the controls and the fit spent is gone, and the
    # combined configuration's own budget comes out of it
    budget_s = max(stage.budget_s - spent_s - stage.combined_budget_s, 0.0)
    plans = plans_to_time(plan, invalid, (unit, cv[0], budget_s), pricing, stage.plan_to_budget)
    valid = [name for name in dict.fromkeys(plans["strategy"]) if name not in invalid]
    return race(
        runner,
        plans,
        plan.settings,
        valid,
        cv,
        (unit, budget_s, stage.round_size, plan.settings.seed),
        progress,
    )


def run_replay(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str | Path],
    cfg: WorkflowConfig,
    model_path: str | Path,
    card_probe: Callable[[int], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the stage and write every output, or none. `cfg` is the whole workflow config:
    sections replay, training, profile and trainer are read."""
    missing = [k for k in OUTPUT_KEYS if k not in outputs]
    if missing:
        raise ReplayError(f"replay: missing path(s) for {missing}")
    started = time.perf_counter()
    plan = prepare(inputs, cfg)
    # the positive control first: cheap, and a broken estimator must not cost a GPU run
    control = synthetic_control_first(plan)
    invalid = invalid_strategies(inputs)
    idle = check_idle_card(cfg.profile.idle, plan.device, card_probe, sleep)
    runner, changes, dtype, described = load_replay_step(plan, cfg, inputs, model_path)
    invalid = {**invalid, **changes.invalid}  # padding-free where documents would mix
    fit, fit_points, loss_share, instrument = measure_model(runner, plan, cfg)
    (cv, cv_df), unit = instrument_noise(instrument, runner)
    pricing = FitPricing(fit.fit, plan.micro, fit.low, fit.high)
    # time_plans adds to `invalid` the changes the budget cannot decide
    design, sequential = time_plans(
        runner, plan, invalid, (cv, cv_df), unit, pricing, progress,
        time.perf_counter() - started,
    )  # fmt: skip
    table = price(plan, sequential, invalid, pricing, cv, changes, cfg.training.max_seq_len)
    combined = time_combined(
        runner, plan, table, changes.changes, inputs, cfg, pricing, (cv, cv_df), unit, progress,
        sequential.record["elapsed_s"] - sequential.record["budget_s"],
    )  # fmt: skip
    table = with_combined(table, combined)
    # the coverage control: the same design and estimator on simulated timings of known cost
    coverage = coverage_control(design, sequential, cv, plan)
    control = completed_control(control, coverage, instrument, sequential, combined, plan)
    provenance = replay_provenance(cfg, plan, dtype, described, changes, idle, started)
    provenance.update(priced_beside(runner, plan.plans, cfg.training, plan.stage, table))
    fit_row = fit_table_row(fit, plan, loss_share)
    steps = steps_table(
        all_steps(sequential.steps, combined), sequential.optimizer_times, fit_points
    )
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("estimates", table, provenance)
        out.parquet("steps", steps, provenance)
        out.parquet("fit", pd.DataFrame([fit_row]), provenance)
        out.parquet("plans", timed_plans(design, combined), provenance)
        out.json("control", control)
    return replay_summary(plan, provenance, control, table)


def timed_plans(design: Any, combined: Any) -> pd.DataFrame:
    """Every configuration's full plan as timed, the combined configuration's after, list
    columns as plain lists (Parquet)."""
    table = pd.concat([plans_table(design), combined.plans], ignore_index=True)
    for column in ("example_ids", "example_lengths", "example_loss_tokens", "documents_per_row"):
        if column in table:
            table[column] = table[column].map(
                lambda v: list(v) if isinstance(v, (list, tuple, np.ndarray)) else []
            )
    return table


def synthetic_control_first(plan: ReplayPlan) -> dict[str, Any]:
    """The busy-wait harness of known cost through the whole estimator; raises when it fails."""
    control_cfg = plan.stage.control
    control = run_synthetic_control(
        plan.plans,
        plan.stage.control_sampling,
        plan.fit_lengths,
        plan.micro,
        fit_repeats=int(control_cfg.fit_repeats),
        saving_tolerance=float(control_cfg.saving_tolerance),
        fit_tolerance=float(control_cfg.fit_tolerance),
        repeats=int(control_cfg.repeats),
    )
    return passed_or_raise(
        control,
        f"control %s ({control['observed']['wall_s']:.1f} s)",
        f"positive control failed: {control['observed']}",
    )


def passed_or_raise(result: dict[str, Any], line: str, failure: str) -> dict[str, Any]:
    """Log a control's outcome (`line` with %s for passed/FAILED) and raise when it failed,
    before any output is written."""
    LOG.info(line, "passed" if result["passed"] else "FAILED")
    if not result["passed"]:
        raise ControlFailedError(f"replay: {failure}, no output written")
    return result
