"""Replay's estimator: price each batching strategy from its timed stratified sample.

What is estimated: an epoch's time, Σ over strata (micro-batches in the stratum × mean measured
time) + optimizer steps × mean optimizer-step time. Strata are log-spaced bands of the tokens a
micro-batch computes over, so rare large micro-batches are sampled as often as common small ones
and weighted by how many there really are.

What the interval means: a 95% percentile bootstrap, resampling the measured times within each
stratum (and the optimizer times): the spread an estimate from this many samples has. Savings
against random use the same bootstrap replicate for both strategies (joint), so the shared
optimizer measurement cancels instead of widening the interval. It does not cover a systematic
error shared by every measurement (another process on the machine, a different card).

The per-strategy table (REPLAY_COLUMNS) adds the rank with ties and the scaling fit's prediction.
The model-assisted (GREG) estimator the stage uses is ``probes.replay.greg``; its names are
importable from here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.contracts import table_columns
from probes.replay.greg import (  # noqa: F401  (re-exported: replay.estimate's public names)
    FEATURES,
    OUTLIER_SPREADS,
    OUTLIER_TIMINGS,
    GregEstimate,
    GregTotal,
    StrategyDesign,
    WorkingModel,
    auxiliaries,
    fit_working_model,
    greg_estimate_all,
    greg_total,
    is_open,
    log_interval,
    open_strategies,
    outlier_units,
    paired_ratio,
    satterthwaite,
    t_quantile_975,
    unit_residuals,
)
from probes.replay.timing import MICRO_BATCH, ReplaySettings
from probes.step import fit as ft
from probes.step.timing import OK

CONFIDENCE = 0.95

# The per-strategy table's columns: the contract's (required first, then optional).
REPLAY_COLUMNS = table_columns("replay_estimates")


# ---------------------------------------------------------------------------------------------
# The estimator and its bootstrap
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrataTimes:
    """One strategy's measurements: per stratum its size and the measured times."""

    sizes: np.ndarray  # micro-batches per stratum in the whole plan
    times: list[np.ndarray]  # measured seconds of the sampled micro-batches, per stratum
    optimizer_steps: int


def strata_times(steps: pd.DataFrame, optimizer_steps: int) -> StrataTimes:
    """From one strategy's rows of the steps table (stratum, stratum_size, time_s)."""
    groups = steps.groupby("stratum", sort=True)
    return StrataTimes(
        sizes=groups["stratum_size"].first().to_numpy(dtype=np.float64),
        times=[g["time_s"].to_numpy(dtype=np.float64) for _, g in groups],
        optimizer_steps=int(optimizer_steps),
    )


def stratified_total(data: StrataTimes, optimizer_mean_s: float) -> float:
    """Σ_h N_h × mean(t_h) + optimizer steps × mean optimizer-step time."""
    micro = sum(n * float(np.mean(t)) for n, t in zip(data.sizes, data.times, strict=True))
    return micro + data.optimizer_steps * optimizer_mean_s


def naive_total(data: StrataTimes, optimizer_mean_s: float) -> float:
    """The estimator that ignores strata: every micro-batch priced at the plain sample mean.
    Biased whenever sampling is not proportional to stratum size; kept for the tests."""
    pooled = np.concatenate(data.times)
    return float(np.sum(data.sizes)) * float(np.mean(pooled)) + (
        data.optimizer_steps * optimizer_mean_s
    )


def bootstrap_means(times: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap replicates of the mean of `times`."""
    times = np.asarray(times, dtype=np.float64)
    draws = rng.integers(0, times.size, size=(resamples, times.size))
    return times[draws].mean(axis=1)


def bootstrap_totals(
    data: StrataTimes, optimizer_replicates: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Replicates of the stratified total, resampling within each stratum; the optimizer mean's
    replicates are passed in so every strategy of one bootstrap shares them (joint bootstrap)."""
    resamples = optimizer_replicates.size
    total = data.optimizer_steps * optimizer_replicates
    for n, times in zip(data.sizes, data.times, strict=True):
        total = total + n * bootstrap_means(times, resamples, rng)
    return total


def percentile_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Estimate:
    time_s: float
    ci_low_s: float
    ci_high_s: float
    replicates: np.ndarray


def estimate_all(
    per_strategy: Mapping[str, StrataTimes],
    optimizer_times: np.ndarray,
    resamples: int,
    seed: int,
    confidence: float = CONFIDENCE,
    total_fn: Callable[[StrataTimes, float], float] = stratified_total,
) -> dict[str, Estimate]:
    """Point estimate and bootstrap interval of every strategy's epoch time (joint replicates)."""
    rng = np.random.default_rng(seed)
    optimizer_times = np.asarray(optimizer_times, dtype=np.float64)
    optimizer_mean = float(np.mean(optimizer_times)) if optimizer_times.size else 0.0
    optimizer_reps = (
        bootstrap_means(optimizer_times, resamples, rng)
        if optimizer_times.size
        else np.zeros(resamples)
    )
    out = {}
    for name, data in per_strategy.items():
        if total_fn is stratified_total:
            replicates = bootstrap_totals(data, optimizer_reps, rng)
        else:  # any other estimator: the same resampling, its own formula on each replicate
            replicates = np.array(
                [
                    total_fn(
                        StrataTimes(
                            data.sizes,
                            [t[rng.integers(0, t.size, t.size)] for t in data.times],
                            data.optimizer_steps,
                        ),
                        float(rep),
                    )
                    for rep in optimizer_reps
                ]
            )
        low, high = percentile_interval(replicates, confidence)
        out[name] = Estimate(total_fn(data, optimizer_mean), low, high, replicates)
    return out


def saving_interval(
    estimate: Estimate, baseline: Estimate, confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """Saving vs the baseline (1 − T/T_base) and its interval from the joint replicates."""
    saving = 1.0 - estimate.time_s / baseline.time_s
    low, high = percentile_interval(1.0 - estimate.replicates / baseline.replicates, confidence)
    return saving, low, high


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
    greg: Mapping[str, GregEstimate] | None = None,
    stopped_by: str | None = None,
    instrument_cv: float | None = None,
) -> pd.DataFrame:
    """One row per strategy (REPLAY_COLUMNS): estimate, interval, saving, rank, fit prediction.
    With `greg` (greg_estimate_all) its estimates and intervals are the table's; without, the
    stratified bootstrap's (kept for comparison: bench/replay_width.py)."""
    summary = pl.plan_summary(plans).set_index("strategy")
    ok_steps = steps[steps["kind"] == MICRO_BATCH]
    invalid = _with_failed_samples(invalid, ok_steps)
    per_strategy = {
        name: strata_times(group, int(summary.loc[name, "optimizer_steps"]))
        for name, group in ok_steps.groupby("strategy", sort=False)
        if (group["status"] == OK).all()
    }
    if greg is None:
        estimates = estimate_all(
            per_strategy, optimizer_times, settings.bootstrap_resamples, settings.seed + 1
        )
    else:
        estimates = {n: e for n, e in greg.items() if n in per_strategy}
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
            "estimator": "model-assisted (GREG)" if greg is not None else "stratified",
            "stopped_by": stopped_by,
            "instrument_cv": float("nan") if instrument_cv is None else float(instrument_cv),
        },
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
    base: Estimate | GregEstimate | None
    invalid: Mapping[str, str]
    extra: Mapping[str, object]  # columns with one value for the whole table


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


def _fit_columns(name: str, info: pd.Series, context: _TableContext, saving: tuple) -> dict:
    """The scaling fit's prediction (a diagnostic) and whether it lies in the interval."""
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


def _strategy_row(
    name: str, est: Estimate | GregEstimate | None, context: _TableContext
) -> dict[str, object]:
    summary, settings = context.summary, context.settings
    info = summary.loc[name]
    nan = float("nan")
    saving = (nan, nan, nan)
    if isinstance(est, GregEstimate):
        saving = (est.saving, est.saving_low, est.saving_high)
    elif est is not None and context.base is not None:
        saving = saving_interval(est, context.base)
    part = context.ok_steps[context.ok_steps["strategy"] == name]
    busy = part["gpu_busy_share"].dropna() if "gpu_busy_share" in part else pd.Series([])
    host_bound = float((busy < settings.host_bound_threshold).mean()) if len(busy) else float("nan")
    steps, base_steps = (
        int(info["optimizer_steps"]),
        int(summary.loc[pl.BASELINE, "optimizer_steps"]),
    )
    greg = est if isinstance(est, GregEstimate) else None
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
