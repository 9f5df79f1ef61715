"""The replay's outputs from what it measured: the estimates table with its notes (``price``),
replay_steps.parquet (``steps_table``), replay_fit.parquet's row (``fit_table_row``), the
control's rows for the report (``control_checks``), the provenance and the log's summary."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching import plans as pl
from probes.replay.estimate import FitPricing, strategy_table
from probes.replay.greg import is_open
from probes.replay.prepare import CPU_NOTE, ReplayPlan
from probes.replay.step_changes import StepChanges
from probes.replay.timing import MICRO_BATCH, OPTIMIZER_STEP
from probes.settings import WorkflowConfig

# the log's summary: each strategy's estimate, saving and rank
SUMMARY_COLUMNS = (
    "strategy",
    "estimated_time_s",
    "ci_low_s",
    "ci_high_s",
    "saving_vs_random",
    "saving_ci_low",
    "saving_ci_high",
    "rank",
    "valid",
)


def race_table(
    plan: ReplayPlan,
    plans: pd.DataFrame,
    race: Any,
    invalid: Mapping[str, str],
    pricing: FitPricing,
    cv: float,
    step_level: Collection[str] = (),
) -> pd.DataFrame:
    """The per-strategy table of a race (sequential.race's result) over `plans`; `step_level`:
    the strategies that change the step (no scaling-fit price)."""
    return strategy_table(
        plans, race.steps, race.optimizer_times, plan.settings, invalid, pricing, plan.cpu_only,
        plan.max_len, greg=race.estimates, stopped_by=race.record["stopped_by"], instrument_cv=cv,
        step_level=step_level,
    )  # fmt: skip


def cpu_note(plan: ReplayPlan, max_seq_len: int) -> str | None:
    """The CPU rehearsal's label every row of the table carries (None on a GPU)."""
    return CPU_NOTE.format(cap=plan.max_len, max_seq_len=max_seq_len) if plan.cpu_only else None


def price(
    plan: ReplayPlan,
    sequential: Any,
    invalid: Mapping[str, str],
    pricing: FitPricing,
    cv: float,
    changes: StepChanges,
    max_seq_len: int,
) -> pd.DataFrame:
    """Each strategy's estimate with its interval, its notes (step-level change, CPU cap)."""
    step_level = [c.strategy for c in changes.changes]
    table = race_table(plan, plan.plans, sequential, invalid, pricing, cv, step_level)
    titles = {c.strategy: f"step-level change: {c.title}" for c in changes.changes}
    notes = [
        f"{titles[s]}; {n}" if s in titles and n else titles.get(s, n)
        for s, n in zip(table["strategy"], table["note"], strict=True)
    ]
    cpu = cpu_note(plan, max_seq_len)
    if cpu:
        notes = [f"{cpu}; {n}" if n else cpu for n in notes]
    table["note"] = notes
    return table


def replay_provenance(
    cfg: WorkflowConfig,
    plan: ReplayPlan,
    dtype: tuple[torch.dtype, str],
    described: dict[str, Any],
    changes: StepChanges,
    idle: Any,
    started: float,
) -> dict[str, Any]:
    """What the replay ran, on what (each table's metadata)."""
    from probes.profile.evidence import timed_run_provenance

    return timed_run_provenance(
        cfg, plan.device, plan.cpu_only, dtype, plan.max_len, described, idle, started,
        step_changes=[
            {"strategy": c.strategy, "title": c.title, "settings": c.settings}
            for c in changes.changes
        ],
        not_measured=dict(changes.not_measured),  # name: why (probes.replay.step_changes)
    )  # fmt: skip


def completed_control(
    control: dict[str, Any],
    coverage: dict[str, Any],
    instrument: dict[str, Any],
    sequential: Any,
    combined: Any,
    plan: ReplayPlan,
) -> dict[str, Any]:
    """replay_control.json: the positive control with the coverage control, the instrument, the
    stopping record and the combined configuration's, one row per check for the report."""
    control.update(
        coverage=coverage, instrument=instrument, stopping=sequential.record,
        combined=combined.record,
    )  # fmt: skip
    control["stopping"]["power"] = {
        **decision_power(sequential, plan.settings, plan.stage.budget_key),
        "configured_budget_s": plan.stage.budget_s,
    }
    control["checks"] = control_checks(control, coverage)
    control["observed"]["cpu_only"] = plan.cpu_only
    # the report shows and applies the threshold the replay used (its one home: the config)
    control["host_bound_threshold"] = plan.settings.host_bound_threshold
    return control


def control_checks(control: dict[str, Any], coverage: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's Controls table lists each check on its own row: the busy-wait harness of
    known cost, and the intervals' coverage control."""
    errors = [v["time_ratio_rel_error"] for v in control["observed"]["strategies"].values()]
    return [
        {
            "name": control["name"],
            "expected": {
                "time_ratio_rel_error_max": control["expected"]["time_ratio_rel_error_max"]
            },
            "observed": {"time_ratio_rel_error_max": max(errors) if errors else None},
            "passed": bool(control["passed"]),
        },
        {
            "name": coverage["name"],
            "expected": {
                "coverage_min": coverage["expected"]["coverage_min"],
                "max_width_pp": coverage["expected"].get("max_width_pp"),
            },
            "observed": {
                "coverage_min": coverage["observed"]["min_coverage"],
                "widest_mean_width_pp": max(
                    coverage["observed"].get("mean_width_pp", {}).values(), default=None
                ),
            },
            "passed": bool(coverage["passed"]),
            "verdict": coverage.get("verdict", "passed" if coverage["passed"] else "failed"),
        },
    ]


def steps_table(
    steps: pd.DataFrame, optimizer_times: np.ndarray, fit_points: pd.DataFrame
) -> pd.DataFrame:
    """replay_steps.parquet: the timed micro-batches, the optimizer steps and the fit's points,
    list columns as plain lists (Parquet)."""
    optimizer_rows = pd.DataFrame(
        {"kind": OPTIMIZER_STEP, "time_s": optimizer_times, "status": "OK"}
    )
    all_steps = pd.concat([steps, optimizer_rows, fit_points], ignore_index=True)
    if "raw_times_s" not in all_steps:
        all_steps["raw_times_s"] = all_steps["times_s"]
    for column in (
        "example_ids", "example_lengths", "example_loss_tokens", "documents_per_row", "times_s",
        "raw_times_s",
    ):  # fmt: skip
        all_steps[column] = all_steps[column].map(
            lambda v: list(v) if isinstance(v, (list, np.ndarray)) else []
        )
    return all_steps


def fit_table_row(fit: Any, plan: ReplayPlan, loss_share: float) -> dict[str, Any]:
    """replay_fit.parquet's one row: the fit with its intervals, and what it was measured on."""
    fit_row = fit.as_row()
    fit_row.update(
        rows=plan.micro,
        loss_share=loss_share,
        cpu_only=plan.cpu_only,
        max_seq_len=plan.max_len,
        lengths_source=plan.stage.fit_lengths_source,
        time_basis="forward + backward of one micro-batch (optimizer step excluded)",
    )
    return fit_row


def replay_summary(
    plan: ReplayPlan, provenance: Mapping[str, Any], control: Mapping[str, Any], table: pd.DataFrame
) -> dict[str, Any]:
    """The log's summary of the stage."""
    return {
        "cpu_only": plan.cpu_only,
        "wall_s": provenance["wall_s"],
        "load_average": provenance["load_average"],
        "control_passed": control["passed"],
        "strategies": table[list(SUMMARY_COLUMNS)].to_dict("records"),
    }


def decision_power(sequential: Any, settings: Any, key: str) -> dict[str, Any]:
    """For each change left undecided, from its measured spread: the units that would decide it
    (its interval's width shrinking as 1/√n, n·(half-width / target)²: the target the larger of
    |saving|, where the interval excludes 0, and decide_within − |saving|, where it lies inside
    ±decide_within; at most max_width / 2) and the seconds they cost at its own and the
    baseline's measured unit times; the sum, and the config key that buys them. A fixed ±5 pp
    target said "about 0 s more" for ties already 9 pp wide that sat near a boundary."""
    steps = sequential.steps
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == "OK")]
    unit_s = ok.groupby("strategy")["time_s"].mean().to_dict()
    counts = ok.groupby("strategy").size().to_dict()
    within = max(float(settings.decide_within), 1e-3)
    per_change = {}
    for name, est in sequential.estimates.items():
        if name == pl.BASELINE or not is_open(est, settings.decide_within, settings.max_width):
            continue
        half = 0.5 * (est.saving_high - est.saving_low)
        n = int(counts.get(name, 0))
        if not (n and math.isfinite(half)):
            continue
        centre = abs(0.5 * (est.saving_high + est.saving_low))
        target = min(max(centre, within - centre, 1e-3), 0.5 * float(settings.max_width))
        more = max(math.ceil(n * (half / target) ** 2 - 1e-9) - n, 1)
        cost = unit_s.get(name, 0.0) + unit_s.get(pl.BASELINE, 0.0)
        per_change[name] = {
            "units": more, "seconds": more * cost, "half_width": half, "target": target
        }  # fmt: skip
    total = float(sum(v["seconds"] for v in per_change.values()))
    return {
        "undecided": sorted(per_change),
        "seconds_to_decide": total,
        "per_change": per_change,
        "target_half_width": within,
        "key": key,
        "rule": "units to decide each undecided change: n x (half-width / target)^2 (target: "
        "the larger of |saving| and decide_within - |saving|), at its own and the baseline's "
        "measured unit times",
    }
