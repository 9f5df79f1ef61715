"""The replay's combined configuration (probes.step.combined): chosen from the priced table,
then timed as one strategy against the baseline in a second, shorter sequential replay through
the same step, estimator and intervals.

The second replay re-times the baseline beside it (interleaved, in the same minutes) rather than
reusing the first replay's baseline, so the combination's saving is a comparison made at one
time, as every other saving is. Its row joins the table; its timed micro-batches join the steps
table; what ran (or why nothing did) is the control record's ``combined``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from probes.batching import plans as pl
from probes.io import read_json, read_provenance
from probes.replay.estimate import FitPricing, ranked
from probes.replay.outputs import cpu_note, race_table
from probes.replay.sequential import plans_table, race
from probes.settings import TrainingConfig, WorkflowConfig
from probes.step import combined as cb

LOG = logging.getLogger("probes.replay")


@dataclass(frozen=True)
class CombinedResult:
    row: pd.DataFrame  # the combination's estimate (REPLAY_COLUMNS), empty when not run
    steps: pd.DataFrame  # its timed micro-batches
    record: dict[str, Any]
    plans: pd.DataFrame = field(default_factory=pd.DataFrame)  # its full plan, with strata


def not_run(why: str) -> CombinedResult:
    LOG.info("combined configuration not measured: %s", why)
    return CombinedResult(pd.DataFrame(), pd.DataFrame(), {"measured": False, "why": why})


def plans_at_shape(
    inputs: Mapping[str, Any], training: TrainingConfig, cap: int | None, shape: tuple[int, int]
) -> pd.DataFrame:
    """Every strategy's plan at another (micro-batch size, grad_accum), built as the device's
    plans are (same seed, same bucket size; lengths scaled to a `cap` rehearsal on CPU)."""
    max_seq_len = int(training.max_seq_len)
    examples = pl.read_examples(inputs["lengths"], max_seq_len)
    if cap is not None:
        examples = pl.rehearsal_examples(examples, cap, max_seq_len)
    return pl.build_plans(
        examples,
        micro_batch_size=shape[0],
        grad_accum=shape[1],
        max_seq_len=cap or max_seq_len,
        bucket_size_batches=pl.recommended_bucket_size(read_json(inputs["recommendation"])),
        seed=int(read_provenance(inputs["plans"]).get("plan_seed", 0)),
    )


def combination_plan(
    combination: cb.Combination, changes: list[Any], plan: Any, inputs: Mapping[str, Any],
    training: TrainingConfig,
) -> pd.DataFrame:  # fmt: skip
    """The baseline's rows and the combination's (its batching plan at its micro-batch size)."""
    shape = cb.micro_shape(changes, plan.micro, plan.grad_accum)
    base_shape = (plan.micro, plan.grad_accum)
    plans_at = {}
    if shape != base_shape:
        cap = plan.max_len if plan.cpu_only else None
        plans_at[shape] = plans_at_shape(inputs, training, cap, shape)
    rows = cb.combined_plan(combination, plan.plans, plans_at, shape, base_shape)
    baseline = plan.plans[plan.plans["strategy"] == pl.BASELINE]
    return pd.concat([baseline, rows], ignore_index=True)


def time_combined(
    runner: Any,
    plan: Any,
    table: pd.DataFrame,
    step_changes: list[Any],
    inputs: Mapping[str, Any],
    cfg: WorkflowConfig,
    pricing: FitPricing,
    cv: tuple[float, float],
    unit: tuple[float, float],
    progress: bool,
    overrun_s: float = 0.0,
) -> CombinedResult:
    """Choose, build, time and price the combined configuration (or say why not); `overrun_s`:
    how far the race ran past its share of the stage's budget, which comes out of this one's (a
    race that spent it all leaves none: on a slowing 2-core host the rule took 149 s of its
    120 s with it)."""
    stage = plan.stage
    if not stage.combined:
        return not_run("replay.combined is false")
    budget_s = stage.combined_budget_s - max(float(overrun_s), 0.0)
    if budget_s <= 0:
        return not_run(
            f"the race before it spent the replay's budget, its {stage.combined_budget_s:g} s "
            f"included ({overrun_s:.0f} s past its own share): raise `{stage.budget_key}`"
        )
    switch = getattr(runner, "switch", None)
    if switch is None or not step_changes:
        return not_run("no step-level change was priced")
    combination = cb.choose(table, switch.base, step_changes)
    if combination is None:
        return not_run(
            "no batching change and no step-level change that both measurably save time "
            "(a saving's 95% interval above 0)"
        )
    chosen = [c for c in step_changes if c.strategy in combination.steps]
    pair = combination_plan(combination, chosen, plan, inputs, cfg.training)
    switch.configs[combination.name] = cb.merged_config(switch.base, chosen)
    settings = plan.settings
    LOG.info("combined configuration %s: timing it beside the baseline", combination.name)
    design, result = race(
        runner, pair, settings, [pl.BASELINE, combination.name], cv,
        (unit, budget_s, stage.round_size, settings.seed + 5), progress,
    )  # fmt: skip
    step_level = [combination.name] if combination.steps else []
    priced = race_table(plan, pair, result, {}, pricing, cv[0], step_level)
    row = priced[priced["strategy"] == combination.name].copy()
    note = (
        f"combined configuration ({', '.join((combination.batching, *combination.steps))}): "
        "timed as one beside the baseline in a second replay"
    )
    row["note"] = "; ".join(n for n in (cpu_note(plan, cfg.training.max_seq_len), note) if n)
    steps = result.steps[result.steps["strategy"] == combination.name]
    record = {
        "measured": True,
        "strategy": combination.name,
        "batching": combination.batching,
        "step_changes": list(combination.steps),
        "baseline_retimed": priced.loc[priced["strategy"] == pl.BASELINE].to_dict("records"),
        "stopping": result.record,
    }
    return CombinedResult(row, steps, record, plans_table(design, [combination.name]))


def with_combined(table: pd.DataFrame, combined: CombinedResult) -> pd.DataFrame:
    """The table with the combination's row, ranked again among all strategies."""
    if combined.row.empty:
        return table
    return ranked(pd.concat([table, combined.row], ignore_index=True))


def all_steps(first: pd.DataFrame, combined: CombinedResult) -> pd.DataFrame:
    """The first replay's timed micro-batches, then the combination's (run order continued)."""
    if combined.steps.empty:
        return first
    later = combined.steps.assign(run_order=combined.steps["run_order"] + len(first))
    return pd.concat([first, later], ignore_index=True)
