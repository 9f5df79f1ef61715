"""Replay's model-assisted (GREG / difference) estimator (its outlier screen: replay.outliers).

A working model of step time, y ≈ xᵀβ, on auxiliaries every plan row carries exactly (FEATURES),
fitted by least squares on the timed micro-batches of every strategy together. A strategy's
micro-batch total is Σ_U ŷ_i (every micro-batch of its plan) + Σ_h N_h · mean residual of its
own sample in stratum h: design-unbiased whatever the model (a wrong model only widens the
interval). Variance (linearised): Σ_h N_h² [(1 − f_h) s²_e,h / n_h + f_h σ²_ε,h / n_h], s_e the
leverage-adjusted residual spread (relative to ŷ, pooled over a strategy's units: greg_total),
σ_ε the noise a timed unit carries, which a census stratum (f_h = 1) still carries: the
instrument's own (CV × stratum mean, per timing), or s_e where that is larger. A unit's spread
beyond the instrument's is timing noise on a CPU (the same shape timed in two strategies differs
as much as two shapes do, 5-11%, while back-to-back repeats vary 1-3%), which a larger sampling
fraction does not remove: counted as a population spread only, with its finite-population
correction, a strategy timed on half its micro-batches at 12% such noise was covered in 0.73 of
simulated runs (0.89 without the correction on that share; tests/unit/replay/test_estimate.py).
Treating the model's misfit as noise too keeps a census interval open: conservative. The
saving 1 − T_s/T_base is
linearised with the optimizer mean shared by both; Student t with Satterthwaite's df.

``probes.replay.estimate`` builds the per-strategy table from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from probes.batching import plans as pl

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
    # each timed unit's row in the plan, and whether the strategy runs the baseline's own
    # micro-batches (a step-level change that keeps them): then it is priced paired
    units: np.ndarray | None = None
    paired: bool = False


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
        instrument = (cv * float(design.y[mine].mean())) ** 2 / float(np.mean(design.timings[mine]))
        # the timed share still carries its units' noise: the instrument's, or the spread the
        # model leaves where larger (the module docstring)
        noise, df = (instrument, cv_df) if instrument >= s2 else (s2, float(design.y.size))
        parts.append((big_n**2 * f * noise / n, df))
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


def log_interval(value: float, se: float, df: float) -> tuple[float, float]:
    """The 95% interval of a positive quantity on the log scale (delta method: se(log v) =
    se/v): value × exp(±t·se/value), never below 0 whatever the spread."""
    if not (value > 0 and math.isfinite(se)):
        return float("nan"), float("nan")
    half = min(t_quantile_975(df) * se / value, 700.0)  # exp overflows past ~709
    return value * math.exp(-half), value * math.exp(half)


@dataclass(frozen=True)
class PairedRatio:
    """A paired change's micro-batch time over the baseline's on the same micro-batches: the
    stratified combined ratio estimate, its 95% interval (log scale) and the variance parts."""

    ratio: float
    low: float
    high: float
    df: float
    parts: tuple[tuple[float, float], ...]  # of the ratio's variance
    pairs: int
    # S_z,h per stratum (seconds): the spread of y_change − R·y_base that the design allocates
    # by, the pooled relative spread × the stratum's baseline level
    strata_sd: dict[int, float] = field(default_factory=dict)


def twin_pairs(change: StrategyDesign, base: StrategyDesign) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into the change's and the baseline's timed units) of the micro-batches both
    timed: a paired change's units and their baseline twins."""
    where = {int(u): i for i, u in enumerate(base.units)}
    pairs = [(i, where[int(u)]) for i, u in enumerate(change.units) if int(u) in where]
    if not pairs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mine, theirs = zip(*pairs, strict=True)
    return np.array(mine, dtype=np.int64), np.array(theirs, dtype=np.int64)


def paired_ratio(
    change: StrategyDesign, base: StrategyDesign, cv: float, cv_df: float
) -> PairedRatio:
    """R = Σ_h N_h ȳ_change,h / Σ_h N_h ȳ_base,h over the micro-batches both timed (the change's
    are a prefix of the baseline's in every stratum: one stratum order). Linearised variance
    Σ_h N_h² [(1 − f_h) S²_z,h + f_h σ²_ε,h] / n_h / X², z = y_change − R·y_base, S²_z pooled
    relative to y_base over all pairs (n − 1 df), σ_ε the instrument's noise of both timings, or
    S_z where that is larger (the module docstring)."""
    mine, theirs = twin_pairs(change, base)
    if mine.size < 2:
        nan = float("nan")
        return PairedRatio(nan, nan, nan, nan, (), int(mine.size))
    y_c, y_b, stratum = change.y[mine], base.y[theirs], change.stratum[mine]
    timings = 0.5 * (change.timings[mine] + base.timings[theirs])
    sizes = np.bincount(change.plan_stratum)
    strata = [h for h in np.flatnonzero(sizes) if (stratum == h).any()]
    num = sum(float(sizes[h]) * float(y_c[stratum == h].mean()) for h in strata)
    den = sum(float(sizes[h]) * float(y_b[stratum == h].mean()) for h in strata)
    ratio = num / den
    relative = (y_c - ratio * y_b) / np.maximum(y_b, 1e-12)
    n = int(mine.size)
    sigma2 = float(np.sum(relative**2)) / max(n - 1, 1)
    sampling, noise, spread = 0.0, 0.0, 0.0
    for h in strata:
        in_h = stratum == h
        n_h, big_n = int(in_h.sum()), float(sizes[h])
        f = min(n_h / big_n, 1.0)
        level2 = float(np.mean(y_b[in_h] ** 2))
        sampling += big_n**2 * (1 - f) * sigma2 * level2 / n_h
        both = cv**2 * float(np.mean((y_c[in_h] ** 2 + ratio**2 * y_b[in_h] ** 2) / timings[in_h]))
        if both >= sigma2 * level2:  # the timed share's noise (the module docstring)
            noise += big_n**2 * f * both / n_h
        else:
            spread += big_n**2 * f * sigma2 * level2 / n_h
    parts = (
        (sampling / den**2, float(max(n - 1, 1))),
        (noise / den**2, cv_df),
        (spread / den**2, float(max(n - 1, 1))),
    )
    df = satterthwaite(parts)
    low, high = log_interval(ratio, math.sqrt(sum(v for v, _ in parts)), df)
    strata_sd = {
        int(h): math.sqrt(sigma2 * float(np.mean(base.y[base.stratum == h] ** 2)))
        for h in np.unique(base.stratum)
    }
    return PairedRatio(ratio, low, high, df, parts, n, strata_sd)


def _fitted_designs(designs: Mapping[str, StrategyDesign]) -> list[str]:
    """The strategies the working model is fitted on: all but the paired ones (a paired change
    runs the baseline's micro-batches at another cost, which the shared model would misprice)."""
    return [n for n, d in designs.items() if not d.paired] or list(designs)


def greg_estimate_all(
    designs: Mapping[str, StrategyDesign],
    optimizer_times: np.ndarray,
    cv: float,
    cv_df: float,
    baseline: str = pl.BASELINE,
) -> tuple[dict[str, GregEstimate], WorkingModel]:
    """Every strategy's epoch time and saving vs `baseline` with 95% intervals (t, Satterthwaite,
    on the log scale: an epoch time and a time ratio are positive). One working model over the
    unpaired strategies' timed units; each strategy's own residuals correct it. An unpaired
    saving's variance is that of T_s − R·T_base over independent samples, plus the shared
    optimizer mean's (k_s − R k_base)² var(ō); a paired change is priced by its ratio to the
    baseline on the same micro-batches (paired_ratio)."""
    fitted = _fitted_designs(designs)
    x = np.concatenate([designs[n].x for n in fitted])
    y = np.concatenate([designs[n].y for n in fitted])
    model, leverage = fit_working_model(x, y)
    bounds = np.cumsum([0] + [len(designs[n].y) for n in fitted])
    totals = {
        n: greg_total(designs[n], model, leverage[bounds[i] : bounds[i + 1]], cv, cv_df)
        for i, n in enumerate(fitted)
    }
    opt = np.asarray(optimizer_times, dtype=np.float64)
    optimizer = (
        float(opt.mean()) if opt.size else 0.0,
        float(np.var(opt, ddof=1) / opt.size) if opt.size > 1 else 0.0,
        max(opt.size - 1.0, 1.0),
    )
    out = {}
    for n in fitted:
        out[n] = _unpaired_estimate(n, designs, totals, optimizer, baseline)
    for n in designs:
        if n not in out:
            out[n] = _paired_estimate(n, designs, totals, optimizer, baseline, (cv, cv_df))
    return {n: out[n] for n in designs}, model


def _unpaired_estimate(
    name: str,
    designs: Mapping[str, StrategyDesign],
    totals: Mapping[str, GregTotal],
    optimizer: tuple[float, float, float],
    baseline: str,
) -> GregEstimate:
    opt_mean, opt_var, opt_df = optimizer
    total = totals[name]
    k = designs[name].optimizer_steps
    time_s = total.time_s + k * opt_mean
    parts = [*total.parts, (k * k * opt_var, opt_df)]
    low_s, high_s = log_interval(time_s, math.sqrt(sum(v for v, _ in parts)), satterthwaite(parts))
    saving = low = high = df = float("nan")
    base = totals.get(baseline)
    if name == baseline:
        saving, low, high, df = 0.0, 0.0, 0.0, float("inf")
    elif base is not None:
        base_s = base.time_s + designs[baseline].optimizer_steps * opt_mean
        ratio = time_s / base_s
        k_base = designs[baseline].optimizer_steps
        s_parts = [
            *total.parts,
            *((ratio * ratio * v, d) for v, d in base.parts),
            ((k - ratio * k_base) ** 2 * opt_var, opt_df),
        ]
        df = satterthwaite(s_parts)
        r_low, r_high = log_interval(ratio, math.sqrt(sum(v for v, _ in s_parts)) / base_s, df)
        saving, low, high = 1.0 - ratio, 1.0 - r_high, 1.0 - r_low
    return GregEstimate(
        time_s, low_s, high_s, saving, low, high, df, total.model_s, total.correction_s,
        total.out_of_range_share, total.strata_residual_sd,
    )  # fmt: skip


def _paired_estimate(
    name: str,
    designs: Mapping[str, StrategyDesign],
    totals: Mapping[str, GregTotal],
    optimizer: tuple[float, float, float],
    baseline: str,
    noise: tuple[float, float],
) -> GregEstimate:
    """A paired change's epoch: R × the baseline's micro-batch total + its optimizer steps; its
    saving's interval maps R's (the epoch ratio is monotone in R)."""
    opt_mean, opt_var, opt_df = optimizer
    base = totals[baseline]
    pair = paired_ratio(designs[name], designs[baseline], *noise)
    k, k_base = designs[name].optimizer_steps, designs[baseline].optimizer_steps
    base_s = base.time_s + k_base * opt_mean

    def epoch(r: float) -> float:
        return r * base.time_s + k * opt_mean

    time_s = epoch(pair.ratio)
    base_var = sum(v for v, _ in base.parts)
    parts = [
        *((base.time_s**2 * v, d) for v, d in pair.parts),
        (pair.ratio**2 * base_var, satterthwaite(base.parts)),
        (k * k * opt_var, opt_df),
    ]
    low_s, high_s = log_interval(time_s, math.sqrt(sum(v for v, _ in parts)), satterthwaite(parts))
    return GregEstimate(
        time_s, low_s, high_s, 1.0 - time_s / base_s, 1.0 - epoch(pair.high) / base_s,
        1.0 - epoch(pair.low) / base_s, pair.df, pair.ratio * base.model_s,
        pair.ratio * base.correction_s, base.out_of_range_share,
        pair.strata_sd or base.strata_residual_sd,  # under 2 pairs: no spread of its own yet
    )  # fmt: skip


def is_open(estimate: GregEstimate, within: float, max_width: float) -> bool:
    """Whether a change is still undecided: its saving interval includes 0 and reaches beyond
    ±`within` (not yet faster, slower, or a tie that cannot matter), or is wider than
    `max_width`. An interval that could not be computed stays open."""
    low, high = estimate.saving_low, estimate.saving_high
    if not (math.isfinite(low) and math.isfinite(high)):
        return True
    settled = low > 0 or high < 0 or (low >= -within and high <= within)
    return not settled or high - low > max_width


def open_strategies(
    estimates: Mapping[str, GregEstimate],
    valid: Sequence[str],
    within: float,
    max_width: float,
    baseline: str = pl.BASELINE,
) -> list[str]:
    """The valid changes the next round still times for the decision (is_open); the rest
    are decided and get no more units (a race: timing goes where it can change the answer)."""
    return [
        n
        for n in valid
        if n != baseline and (n not in estimates or is_open(estimates[n], within, max_width))
    ]
