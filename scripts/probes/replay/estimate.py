"""Replay's per-strategy table: each strategy's epoch time and saving from the model-assisted
(GREG) estimator (``probes.replay.greg``), its rank with ties, and the scaling fit's prediction
beside it (a diagnostic, never outside its range).

What is estimated: an epoch's time, Σ over every micro-batch of the plan of the working model's
prediction, corrected by the strategy's own residuals per stratum (strata are log-spaced bands of
the tokens a micro-batch computes over), + optimizer steps × the mean optimizer-step time; the
95% interval is formed on the log scale (greg.log_interval), so no time it implies is negative.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.contracts import table_columns
from probes.replay.greg import GregEstimate
from probes.replay.timing import MICRO_BATCH, ReplaySettings
from probes.step import fit as ft
from probes.step.timing import OK

# The per-strategy table's columns: the contract's (required first, then optional).
REPLAY_COLUMNS = table_columns("replay_estimates")


# ---------------------------------------------------------------------------------------------
# Ranks with ties
# ---------------------------------------------------------------------------------------------


def rank_with_ties(
    names: Sequence[str], savings: Sequence[float], lows: Sequence[float], highs: Sequence[float]
) -> dict[str, tuple[int, int]]:
    """(rank, tie group) per strategy, by measured saving, best first. A strategy whose interval
    overlaps the interval of its group's best member joins that group (a tie): rank is the
    group's position."""
    order = sorted(range(len(names)), key=lambda i: -savings[i])
    out: dict[str, tuple[int, int]] = {}
    group, leader, leader_rank = 0, None, 0
    for position, i in enumerate(order, 1):
        if leader is None or highs[i] < lows[leader]:
            group += 1
            leader, leader_rank = i, position
        out[names[i]] = (leader_rank, group)
    return out


# ---------------------------------------------------------------------------------------------
# The per-strategy table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitPricing:
    """The scaling fit as a diagnostic: t(T) for rows × T padded micro-batches, measured range."""

    fit: ft.QuadraticFit
    rows: int
    low: int
    high: int


def fit_priced_time(
    plan: pd.DataFrame, pricing: FitPricing | None, optimizer_s: float, optimizer_steps: int
) -> tuple[float, str]:
    """A strategy's epoch time from the fit, only where every micro-batch lies in what the fit
    measured (padded layout, ≤ its rows, padded length within its lengths); else NaN + reason."""
    if pricing is None or not pricing.fit.usable:
        return float("nan"), "no usable fit"
    if (plan["layout"] != pl.PADDED).any():
        return float("nan"), (
            "packed micro-batches (one flattened row of documents) are not a shape the fit "
            "measured (rows x T padded batches)"
        )
    lengths = plan["padded_length"].to_numpy()
    low, high = int(lengths.min()), int(lengths.max())
    if low < pricing.low or high > pricing.high:
        return float("nan"), (
            f"padded lengths {low}..{high} reach outside the fit's measured range "
            f"{pricing.low}..{pricing.high}: never extrapolated"
        )
    if int(plan["rows"].max()) > pricing.rows:
        return float("nan"), f"micro-batches of more than the fit's {pricing.rows} rows"
    fit = pricing.fit
    micro = float(np.sum(fit.a * lengths.astype(np.float64) ** 2 + fit.b * lengths + fit.c))
    note = ""
    if int(plan["rows"].min()) < pricing.rows:
        note = "; a final partial micro-batch is priced as a full one"
    return micro + optimizer_steps * optimizer_s, "priced inside the fit's measured range" + note


def strategy_table(
    plans: pd.DataFrame,
    steps: pd.DataFrame,
    optimizer_times: np.ndarray,
    settings: ReplaySettings,
    invalid: Mapping[str, str] | None = None,
    pricing: FitPricing | None = None,
    cpu_only: bool = False,
    max_seq_len: int | None = None,
    *,
    greg: Mapping[str, GregEstimate],
    stopped_by: str | None = None,
    instrument_cv: float | None = None,
    step_level: Collection[str] = (),
) -> pd.DataFrame:
    """One row per strategy (REPLAY_COLUMNS): estimate, interval, saving, rank, fit prediction
    (none for the `step_level` strategies: STEP_NOT_FITTED); the estimates and intervals are
    `greg`'s (greg_estimate_all), for the strategies whose every sampled micro-batch timed."""
    summary = pl.plan_summary(plans).set_index("strategy")
    ok_steps = steps[steps["kind"] == MICRO_BATCH]
    invalid = _with_failed_samples(invalid, ok_steps)
    timed = {
        name
        for name, group in ok_steps.groupby("strategy", sort=False)
        if (group["status"] == OK).all()
    }
    estimates = {n: e for n, e in greg.items() if n in timed}
    optimizer_s = float(np.mean(optimizer_times)) if len(optimizer_times) else 0.0
    context = _TableContext(
        summary=summary,
        plans=plans,
        ok_steps=ok_steps,
        settings=settings,
        pricing=pricing,
        optimizer_s=optimizer_s,
        fit_base=_fit_baseline(plans, summary, pricing, optimizer_s),
        base=estimates.get(pl.BASELINE),
        invalid=invalid,
        extra={
            "cpu_only": cpu_only,
            "max_seq_len": max_seq_len,
            "estimator": "model-assisted (GREG)",
            "stopped_by": stopped_by,
            "instrument_cv": float("nan") if instrument_cv is None else float(instrument_cv),
        },
        step_level=frozenset(step_level),
    )
    rows = [_strategy_row(name, estimates.get(name), context) for name in summary.index]
    return ranked(pd.DataFrame(rows))


@dataclass(frozen=True)
class _TableContext:
    """What every row of the strategy table is computed from."""

    summary: pd.DataFrame  # plan_summary, indexed by strategy
    plans: pd.DataFrame
    ok_steps: pd.DataFrame  # the timed micro-batches
    settings: ReplaySettings
    pricing: FitPricing | None
    optimizer_s: float
    fit_base: float  # the baseline's epoch time from the fit (NaN where it cannot be priced)
    base: GregEstimate | None
    invalid: Mapping[str, str]
    extra: Mapping[str, object]  # columns with one value for the whole table
    step_level: Collection[str] = ()  # changes to the step: the base step's fit cannot price them


def _with_failed_samples(invalid: Mapping[str, str] | None, ok_steps: pd.DataFrame) -> dict:
    """The caller's invalid strategies, plus any whose sampled micro-batches failed."""
    invalid = dict(invalid or {})
    for name, group in ok_steps.groupby("strategy"):
        if (group["status"] != OK).any():
            invalid.setdefault(
                name,
                f"{int((group['status'] != OK).sum())} sampled micro-batch(es) failed "
                f"({sorted(set(group['status']) - {OK})}): the strategy does not run as planned",
            )
    return invalid


def _fit_baseline(
    plans: pd.DataFrame, summary: pd.DataFrame, pricing: FitPricing | None, optimizer_s: float
) -> float:
    if pl.BASELINE not in summary.index:
        return float("nan")
    time_s, _ = fit_priced_time(
        plans[plans["strategy"] == pl.BASELINE],
        pricing,
        optimizer_s,
        int(summary.loc[pl.BASELINE, "optimizer_steps"]),
    )
    return time_s


STEP_NOT_FITTED = (
    "a step-level change: the scaling fit times the base step, so it cannot price a change to "
    "the step itself"
)


def _fit_columns(name: str, info: pd.Series, context: _TableContext, saving: tuple) -> dict:
    """The scaling fit's prediction (a diagnostic) and whether it lies in the interval; none for
    a change to the step (the base step's fit would price it at no saving and then call the
    measurement wrong)."""
    if name in context.step_level:
        return {
            "fit_predicted_saving": float("nan"),
            "fit_predicted_time_s": float("nan"),
            "fit_agrees": None,
            "fit_reason": STEP_NOT_FITTED,
        }
    fit_time, fit_reason = fit_priced_time(
        context.plans[context.plans["strategy"] == name],
        context.pricing,
        context.optimizer_s,
        int(info["optimizer_steps"]),
    )
    fit_saving = float("nan")
    if math.isfinite(fit_time) and math.isfinite(context.fit_base):
        fit_saving = 1.0 - fit_time / context.fit_base
    elif math.isfinite(fit_time):
        fit_reason = "the random baseline lies outside the fit's measured range"
    agrees = None
    if math.isfinite(fit_saving) and math.isfinite(saving[1]):
        agrees = bool(saving[1] <= fit_saving <= saving[2])
    return {
        "fit_predicted_saving": fit_saving,
        "fit_predicted_time_s": fit_time,
        "fit_agrees": agrees,
        "fit_reason": fit_reason,
    }


def _strategy_row(name: str, est: GregEstimate | None, context: _TableContext) -> dict[str, object]:
    summary, settings = context.summary, context.settings
    info = summary.loc[name]
    nan = float("nan")
    saving = (est.saving, est.saving_low, est.saving_high) if est is not None else (nan, nan, nan)
    part = context.ok_steps[context.ok_steps["strategy"] == name]
    busy = part["gpu_busy_share"].dropna() if "gpu_busy_share" in part else pd.Series([])
    host_bound = float((busy < settings.host_bound_threshold).mean()) if len(busy) else float("nan")
    steps, base_steps = (
        int(info["optimizer_steps"]),
        int(summary.loc[pl.BASELINE, "optimizer_steps"]),
    )
    greg = est
    fit = _fit_columns(name, info, context, saving)
    return {
        "strategy": name,
        "valid": name not in context.invalid,
        "invalid_reason": context.invalid.get(name),
        "micro_batches": int(info["micro_batches"]),
        "sampled": int(len(part)),
        "strata": int(part["stratum"].nunique()) if len(part) else 0,
        "estimated_time_s": est.time_s if est else nan,
        "ci_low_s": est.ci_low_s if est else nan,
        "ci_high_s": est.ci_high_s if est else nan,
        "saving_vs_random": saving[0],
        "saving_ci_low": saving[1],
        "saving_ci_high": saving[2],
        "optimizer_steps": steps,
        "optimizer_step_s": context.optimizer_s,
        "tokens_per_optimizer_step": float(info["tokens_per_optimizer_step"]),
        "grad_accum": settings.grad_accum,
        "grad_accum_for_same_tokens": pl.grad_accum_for_same_tokens(
            float(info["real_tokens_per_micro_batch"]),
            float(summary.loc[pl.BASELINE, "real_tokens_per_micro_batch"]),
            settings.grad_accum,
        ),
        "real_tokens": int(info["real_tokens"]),
        "computed_tokens": int(info["computed_tokens"]),
        "gpu_busy_share": float(busy.mean()) if len(busy) else nan,
        "host_bound_share": host_bound,
        **fit,
        "cpu_only": context.extra["cpu_only"],
        "max_seq_len": context.extra["max_seq_len"],
        "note": (
            f"optimizer steps {steps} vs random's {base_steps}: tokens per update "
            "change (a hyperparameter change, not only a speed-up)"
            if steps != base_steps
            else ""
        ),
        "estimator": context.extra["estimator"],
        "saving_df": greg.saving_df if greg else nan,
        "model_time_s": greg.model_s if greg else nan,
        "correction_s": greg.correction_s if greg else nan,
        "model_out_of_range_share": greg.out_of_range_share if greg else nan,
        "stopped_by": context.extra["stopped_by"],
        "instrument_cv": context.extra["instrument_cv"],
    }


def ranked(table: pd.DataFrame) -> pd.DataFrame:
    """Rank with ties among the valid strategies with a saving; REPLAY_COLUMNS, ranked first."""
    table = table.copy()
    priced = table[table["valid"].astype(bool) & table["saving_vs_random"].notna()]
    ranks = rank_with_ties(
        priced["strategy"].tolist(),
        priced["saving_vs_random"].tolist(),
        priced["saving_ci_low"].tolist(),
        priced["saving_ci_high"].tolist(),
    )
    table["rank"] = table["strategy"].map(lambda s: ranks.get(s, (None, None))[0]).astype("Int64")
    table["tie_group"] = (
        table["strategy"].map(lambda s: ranks.get(s, (None, None))[1]).astype("Int64")
    )
    table = table.sort_values(["rank", "strategy"], na_position="last").reset_index(drop=True)
    return table[list(REPLAY_COLUMNS)]
