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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.contracts import table_columns
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
    invalid = dict(invalid or {})
    summary = pl.plan_summary(plans).set_index("strategy")
    ok_steps = steps[steps["kind"] == MICRO_BATCH]
    for name, group in ok_steps.groupby("strategy"):
        if (group["status"] != OK).any():
            invalid.setdefault(
                name,
                f"{int((group['status'] != OK).sum())} sampled micro-batch(es) failed "
                f"({sorted(set(group['status']) - {OK})}): the strategy does not run as planned",
            )
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
    base = estimates.get(pl.BASELINE)
    optimizer_s = float(np.mean(optimizer_times)) if len(optimizer_times) else 0.0
    base_tokens = float(summary.loc[pl.BASELINE, "real_tokens_per_micro_batch"])
    fit_base, _ = (
        fit_priced_time(
            plans[plans["strategy"] == pl.BASELINE],
            pricing,
            optimizer_s,
            int(summary.loc[pl.BASELINE, "optimizer_steps"]),
        )
        if pl.BASELINE in summary.index
        else (float("nan"), "")
    )
    rows = []
    for name in summary.index:
        info = summary.loc[name]
        est = estimates.get(name)
        nan = float("nan")
        saving = (nan, nan, nan)
        if isinstance(est, GregEstimate):
            saving = (est.saving, est.saving_low, est.saving_high)
        elif est is not None and base is not None:
            saving = saving_interval(est, base)
        part = ok_steps[ok_steps["strategy"] == name]
        busy = part["gpu_busy_share"].dropna() if "gpu_busy_share" in part else pd.Series([])
        host_bound = (
            float((busy < settings.host_bound_threshold).mean()) if len(busy) else float("nan")
        )
        fit_time, fit_reason = fit_priced_time(
            plans[plans["strategy"] == name], pricing, optimizer_s, int(info["optimizer_steps"])
        )
        fit_saving = nan
        if math.isfinite(fit_time) and math.isfinite(fit_base):
            fit_saving = 1.0 - fit_time / fit_base
        elif math.isfinite(fit_time):
            fit_reason = "the random baseline lies outside the fit's measured range"
        agrees = None
        if math.isfinite(fit_saving) and math.isfinite(saving[1]):
            agrees = bool(saving[1] <= fit_saving <= saving[2])
        steps_changed = int(info["optimizer_steps"]) != int(
            summary.loc[pl.BASELINE, "optimizer_steps"]
        )
        rows.append(
            {
                "strategy": name,
                "valid": name not in invalid,
                "invalid_reason": invalid.get(name),
                "micro_batches": int(info["micro_batches"]),
                "sampled": int(len(part)),
                "strata": int(part["stratum"].nunique()) if len(part) else 0,
                "estimated_time_s": est.time_s if est else nan,
                "ci_low_s": est.ci_low_s if est else nan,
                "ci_high_s": est.ci_high_s if est else nan,
                "saving_vs_random": saving[0],
                "saving_ci_low": saving[1],
                "saving_ci_high": saving[2],
                "optimizer_steps": int(info["optimizer_steps"]),
                "optimizer_step_s": optimizer_s,
                "tokens_per_optimizer_step": float(info["tokens_per_optimizer_step"]),
                "grad_accum": settings.grad_accum,
                "grad_accum_for_same_tokens": pl.grad_accum_for_same_tokens(
                    float(info["real_tokens_per_micro_batch"]), base_tokens, settings.grad_accum
                ),
                "real_tokens": int(info["real_tokens"]),
                "computed_tokens": int(info["computed_tokens"]),
                "gpu_busy_share": float(busy.mean()) if len(busy) else nan,
                "host_bound_share": host_bound,
                "fit_predicted_saving": fit_saving,
                "fit_predicted_time_s": fit_time,
                "fit_agrees": agrees,
                "fit_reason": fit_reason,
                "cpu_only": cpu_only,
                "max_seq_len": max_seq_len,
                "note": (
                    f"optimizer steps {int(info['optimizer_steps'])} vs random's "
                    f"{int(summary.loc[pl.BASELINE, 'optimizer_steps'])}: tokens per update "
                    "change (a hyperparameter change, not only a speed-up)"
                    if steps_changed
                    else ""
                ),
                "estimator": "model-assisted (GREG)" if greg is not None else "stratified",
                "saving_df": est.saving_df if isinstance(est, GregEstimate) else nan,
                "model_time_s": est.model_s if isinstance(est, GregEstimate) else nan,
                "correction_s": est.correction_s if isinstance(est, GregEstimate) else nan,
                "model_out_of_range_share": (
                    est.out_of_range_share if isinstance(est, GregEstimate) else nan
                ),
                "stopped_by": stopped_by,
                "instrument_cv": nan if instrument_cv is None else float(instrument_cv),
            }
        )
    table = pd.DataFrame(rows)
    ranked = table[table["valid"] & table["saving_vs_random"].notna()]
    ranks = rank_with_ties(
        ranked["strategy"].tolist(),
        ranked["saving_vs_random"].tolist(),
        ranked["saving_ci_low"].tolist(),
        ranked["saving_ci_high"].tolist(),
    )
    table["rank"] = table["strategy"].map(lambda s: ranks.get(s, (None, None))[0]).astype("Int64")
    table["tie_group"] = (
        table["strategy"].map(lambda s: ranks.get(s, (None, None))[1]).astype("Int64")
    )
    table = table.sort_values(["rank", "strategy"], na_position="last").reset_index(drop=True)
    return table[list(REPLAY_COLUMNS)]


# ---------------------------------------------------------------------------------------------
# The model-assisted (GREG / difference) estimator
# ---------------------------------------------------------------------------------------------
#
# A working model of step time, y ≈ xᵀβ, on auxiliaries every plan row carries exactly (FEATURES),
# fitted by least squares on the timed micro-batches of every strategy together. A strategy's
# micro-batch total is Σ_U ŷ_i (every micro-batch of its plan) + Σ_h N_h · mean residual of its
# own sample in stratum h: design-unbiased whatever the model (a wrong model only widens the
# interval). Variance (linearised): Σ_h N_h² [(1 − f_h) s²_e,h / n_h + f_h σ²_ε,h / n_h], s_e the
# leverage-adjusted residual spread (relative to ŷ, pooled over a strategy's units: greg_total),
# σ_ε the instrument's own noise (CV × stratum mean, per
# timing), which a census stratum (f_h = 1) still carries. The saving 1 − T_s/T_base is
# linearised with the optimizer mean shared by both; Student t with Satterthwaite's df.

FEATURES = ("intercept", "shape_tokens", "shape_tokens_x_length", "loss_tokens", "has_loss")


def auxiliaries(frame: pd.DataFrame) -> np.ndarray:
    """The working model's columns for plan rows: 1, rows·T, rows·T² (T the tensor's length: the
    padded length, or a packed micro-batch's one flattened row), loss tokens, and whether the
    micro-batch has any loss token: a harness that runs its LM head and loss on the loss positions
    only (the reference one does) pays a fixed cost per micro-batch that trains at all, and skips
    it for one that does not. On the default run on CPU this column took the working model's
    relative residual from 7.3% to 2.1%, near the instrument's own 2.9% CV."""
    packed = (frame["layout"] == pl.PACKED).to_numpy()
    rows = np.where(packed, 1.0, frame["rows"].to_numpy(dtype=np.float64))
    length = np.where(
        packed,
        frame["computed_tokens"].to_numpy(dtype=np.float64),
        frame["padded_length"].to_numpy(dtype=np.float64),
    )
    loss = frame["loss_tokens"].to_numpy(dtype=np.float64)
    has_loss = (loss > 0).astype(np.float64)
    return np.column_stack([np.ones(len(frame)), rows * length, rows * length**2, loss, has_loss])


@dataclass(frozen=True)
class WorkingModel:
    coef: np.ndarray  # on the scaled columns
    scale: np.ndarray
    low: np.ndarray  # the fitted sample's range per column
    high: np.ndarray
    r_squared: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        return (x / self.scale) @ self.coef

    def out_of_range(self, x: np.ndarray) -> np.ndarray:
        """Rows with an auxiliary outside the range the timed sample covered."""
        slack = 1e-9 * np.maximum(np.abs(self.high), 1.0)
        return ((x < self.low - slack) | (x > self.high + slack)).any(axis=1)


def fit_working_model(x: np.ndarray, y: np.ndarray) -> tuple[WorkingModel, np.ndarray]:
    """Least squares on columns scaled to their largest value (minimum-norm where the sample
    cannot tell columns apart); returns the model and each timed unit's leverage."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    xs = x / scale
    coef, *_ = np.linalg.lstsq(xs, y, rcond=1e-10)
    leverage = np.einsum("ij,jk,ik->i", xs, np.linalg.pinv(xs.T @ xs, rcond=1e-10), xs)
    fitted = xs @ coef
    spread = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - fitted) ** 2)) / spread if spread > 0 else 1.0
    model = WorkingModel(coef, scale, x.min(axis=0), x.max(axis=0), r2)
    return model, np.clip(leverage, 0.0, 0.95)


_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}


def t_quantile_975(df: float) -> float:
    """Student t's 0.975 quantile: exact for df ≤ 4, else a Cornish-Fisher expansion (error
    below 0.001 from df 5); the normal 1.96 as df → ∞."""
    if not math.isfinite(df) or df > 1e6:
        return 1.959964
    if df < 1:
        df = 1.0
    if df <= 4:
        low, high = math.floor(df), math.ceil(df)
        if low == high:
            return _T975[int(low)]
        w = df - low
        return (1 - w) * _T975[int(low)] + w * _T975[int(high)]
    z, v = 1.959964, df
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


def satterthwaite(parts: Sequence[tuple[float, float]]) -> float:
    """Effective df of a sum of variance components (value, df)."""
    total = sum(v for v, _ in parts)
    denominator = sum(v * v / d for v, d in parts if v > 0 and d > 0)
    return total * total / denominator if denominator > 0 else float("inf")


@dataclass(frozen=True)
class StrategyDesign:
    """One strategy for the GREG estimator: every plan row's auxiliaries and stratum, and its
    timed units (stratum, auxiliaries, mean measured time, timings per unit)."""

    plan_x: np.ndarray
    plan_stratum: np.ndarray
    optimizer_steps: int
    stratum: np.ndarray
    x: np.ndarray
    y: np.ndarray
    timings: np.ndarray


@dataclass(frozen=True)
class GregTotal:
    time_s: float
    model_s: float  # Σ over the plan of the model's prediction
    correction_s: float  # Σ_h N_h · mean residual
    parts: tuple[tuple[float, float], ...]  # variance components (value, df) of the micro total
    out_of_range_share: float
    strata_residual_sd: dict[int, float]


def greg_total(
    design: StrategyDesign, model: WorkingModel, leverage: np.ndarray, cv: float, cv_df: float
) -> GregTotal:
    """Σ_U ŷ + Σ_h N_h ē_h and its linearised variance components.

    The residual spread is estimated relative to the model's prediction, pooled over the
    strategy's timed units (S_h² = σ_r² · mean_{U_h} ŷ², σ_r² = mean of (e/ŷ)² over its units,
    uncentred: a residual mean the model leaves in a stratum only widens it), so the interval has
    the strategy's n degrees of freedom rather than one per stratum of two."""
    predicted = model.predict(design.plan_x)
    residual = design.y - model.predict(design.x)
    adjusted = residual / np.sqrt(1.0 - leverage)
    floor = 0.1 * float(np.median(np.abs(design.y))) if design.y.size else 1e-12
    relative = adjusted / np.maximum(model.predict(design.x), max(floor, 1e-12))
    sigma2_rel = float(np.mean(relative**2)) if design.y.size else 0.0
    sizes = np.bincount(design.plan_stratum)
    correction, sampling, parts, spreads = 0.0, 0.0, [], {}
    for h in np.flatnonzero(sizes):
        mine = design.stratum == h
        n, big_n = int(mine.sum()), float(sizes[h])
        if n == 0:
            raise ValueError(f"stratum {h} of {int(big_n)} micro-batches has no timed unit")
        correction += big_n * float(residual[mine].mean())
        f = n / big_n
        level2 = float(np.mean(np.maximum(predicted[design.plan_stratum == h], floor) ** 2))
        s2 = sigma2_rel * level2
        spreads[int(h)] = math.sqrt(s2)
        sampling += big_n**2 * (1 - f) * s2 / n
        noise = (cv * float(design.y[mine].mean())) ** 2 / float(np.mean(design.timings[mine]))
        parts.append((big_n**2 * f * noise / n, cv_df))
    parts.insert(0, (sampling, float(max(design.y.size, 1))))
    model_s = float(predicted.sum())
    return GregTotal(
        model_s + correction,
        model_s,
        correction,
        tuple(parts),
        float(model.out_of_range(design.plan_x).mean()),
        spreads,
    )


@dataclass(frozen=True)
class GregEstimate:
    time_s: float
    ci_low_s: float
    ci_high_s: float
    saving: float
    saving_low: float
    saving_high: float
    saving_df: float
    model_s: float
    correction_s: float
    out_of_range_share: float
    strata_residual_sd: dict[int, float]


def greg_estimate_all(
    designs: Mapping[str, StrategyDesign],
    optimizer_times: np.ndarray,
    cv: float,
    cv_df: float,
    baseline: str = pl.BASELINE,
) -> tuple[dict[str, GregEstimate], WorkingModel]:
    """Every strategy's epoch time and saving vs `baseline` with 95% intervals (t, Satterthwaite).
    One working model over every strategy's timed units; each strategy's own residuals correct
    it. The saving's variance is that of T_s − R·T_base over independent samples, plus the shared
    optimizer mean's (k_s − R k_base)² var(ō)."""
    names = list(designs)
    x = np.concatenate([designs[n].x for n in names])
    y = np.concatenate([designs[n].y for n in names])
    model, leverage = fit_working_model(x, y)
    bounds = np.cumsum([0] + [len(designs[n].y) for n in names])
    totals = {
        n: greg_total(designs[n], model, leverage[bounds[i] : bounds[i + 1]], cv, cv_df)
        for i, n in enumerate(names)
    }
    opt = np.asarray(optimizer_times, dtype=np.float64)
    opt_mean = float(opt.mean()) if opt.size else 0.0
    opt_var = float(np.var(opt, ddof=1) / opt.size) if opt.size > 1 else 0.0
    opt_df = max(opt.size - 1.0, 1.0)
    times = {n: totals[n].time_s + designs[n].optimizer_steps * opt_mean for n in names}
    out = {}
    base = totals.get(baseline)
    for n in names:
        k = designs[n].optimizer_steps
        parts = [*totals[n].parts, (k * k * opt_var, opt_df)]
        var = sum(v for v, _ in parts)
        half = t_quantile_975(satterthwaite(parts)) * math.sqrt(var)
        saving = low = high = df = float("nan")
        if base is not None:
            ratio = times[n] / times[baseline]
            saving = 1.0 - ratio
            if n == baseline:
                low = high = 0.0
                df = float("inf")
            else:
                k_base = designs[baseline].optimizer_steps
                s_parts = [
                    *totals[n].parts,
                    *((ratio * ratio * v, d) for v, d in base.parts),
                    ((k - ratio * k_base) ** 2 * opt_var, opt_df),
                ]
                se = math.sqrt(sum(v for v, _ in s_parts)) / times[baseline]
                df = satterthwaite(s_parts)
                s_half = t_quantile_975(df) * se
                low, high = saving - s_half, saving + s_half
        out[n] = GregEstimate(
            times[n],
            times[n] - half,
            times[n] + half,
            saving,
            low,
            high,
            df,
            totals[n].model_s,
            totals[n].correction_s,
            totals[n].out_of_range_share,
            totals[n].strata_residual_sd,
        )
    return out, model


# A unit timed once whose relative residual lies this many robust spreads (1.4826 × MAD) from
# the rest is timed twice more and priced at the median of its three timings: on the default CPU
# run one preempted micro-batch (+28%, the next largest +13%) took global_sort's interval from
# 6.8 to 14.1 pp wide; for normal noise 3.5 spreads flag 0.05% of units.
OUTLIER_SPREADS = 3.5
OUTLIER_TIMINGS = 3


def outlier_units(relative: np.ndarray, timings: np.ndarray, cv: float) -> np.ndarray:
    """Mask of the units to time again: relative residual (e/ŷ) beyond OUTLIER_SPREADS robust
    spreads of all units (never inside the instrument's own 3 × CV), and fewer than
    OUTLIER_TIMINGS timings so far."""
    relative = np.asarray(relative, dtype=np.float64)
    if relative.size < 8:
        return np.zeros(relative.size, dtype=bool)
    centre = float(np.median(relative))
    spread = 1.4826 * float(np.median(np.abs(relative - centre)))
    limit = max(OUTLIER_SPREADS * spread, 3.0 * cv)
    return (np.abs(relative - centre) > limit) & (np.asarray(timings) < OUTLIER_TIMINGS)


def unit_residuals(designs: Mapping[str, StrategyDesign]) -> dict[str, np.ndarray]:
    """Each strategy's timed units' relative residuals e/ŷ under the working model fitted on
    every strategy's units together (as greg_estimate_all fits it)."""
    names = list(designs)
    x = np.concatenate([designs[n].x for n in names])
    y = np.concatenate([designs[n].y for n in names])
    model, _ = fit_working_model(x, y)
    return {
        n: (designs[n].y - model.predict(designs[n].x))
        / np.maximum(np.abs(model.predict(designs[n].x)), 1e-12)
        for n in names
    }


def decided(estimates: Mapping[str, GregEstimate], valid: Sequence[str]) -> bool:
    """The stopping rule's decision: the best valid strategy's saving interval (random's is
    [0, 0]) lies entirely above the next one's."""
    ranked = sorted(
        (estimates[n] for n in valid if n in estimates and math.isfinite(estimates[n].saving)),
        key=lambda e: -e.saving,
    )
    return len(ranked) >= 2 and ranked[0].saving_low > ranked[1].saving_high
