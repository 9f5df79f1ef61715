"""The step-time scaling fit t(T) = a*T^2 + b*T + c and its positive control.

Three terms (quadratic attention, linear per-token work, fixed per-step cost) need three lengths:
two points over three terms are underdetermined. With exactly three the fit is exact (no residual
to judge it by); with more it is least squares and the residuals say how well the model holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from probes.errors import ProbeError

MIN_POINTS = 3


class FitLengthsError(ProbeError, ValueError):
    """No set of distinct fit lengths fits under the length cap the replay runs at."""


@dataclass(frozen=True)
class QuadraticFit:
    """Coefficients in seconds: a per token^2, b per token, c per step (NaN when not fitted)."""

    a: float
    b: float
    c: float
    n_points: int
    method: str  # exact | least_squares | insufficient_points
    condition_number: float  # of the column-scaled design matrix [T^2, T, 1]
    residual_rms_s: float  # NaN for an exact fit: three points leave no residual
    max_rel_residual: float
    r_squared: float
    lengths: list[int] = field(default_factory=list)
    residuals_s: list[float] = field(default_factory=list)
    message: str = ""

    @property
    def usable(self) -> bool:
        return self.n_points >= MIN_POINTS and math.isfinite(self.a)

    def predict(self, length: float) -> float:
        return self.a * length * length + self.b * length + self.c

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def _design(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[T^2, T, 1] with each column scaled to max 1, and the scales (for conditioning and solve)."""
    raw = np.stack([lengths**2, lengths, np.ones_like(lengths)], axis=1)
    scale = np.abs(raw).max(axis=0)
    scale[scale == 0] = 1.0
    return raw / scale, scale


def fit_step_time(lengths: Sequence[float], times_s: Sequence[float]) -> QuadraticFit:
    """Fit t(T) = aT^2 + bT + c: exact for 3 distinct lengths, least squares beyond, else refuse."""
    x = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(times_s, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n_distinct = len(np.unique(x))
    if n_distinct < MIN_POINTS:
        nan = float("nan")
        return QuadraticFit(
            nan,
            nan,
            nan,
            n_points=int(len(x)),
            method="insufficient_points",
            condition_number=nan,
            residual_rms_s=nan,
            max_rel_residual=nan,
            r_squared=nan,
            lengths=[int(v) for v in x],
            message=(
                f"only {n_distinct} distinct length(s) with a measured time; t(T)=aT^2+bT+c "
                f"needs >= {MIN_POINTS} (two points over three terms are underdetermined)"
            ),
        )
    design, scale = _design(x)
    condition = float(np.linalg.cond(design))
    if len(x) == MIN_POINTS:
        scaled = np.linalg.solve(design, y)
        method = "exact"
    else:
        scaled, *_ = np.linalg.lstsq(design, y, rcond=None)
        method = "least_squares"
    a, b, c = (scaled / scale).tolist()
    fitted = design @ scaled
    residuals = y - fitted
    exact = method == "exact"
    rms = float("nan") if exact else float(np.sqrt(np.mean(residuals**2)))
    rel = float("nan") if exact else float(np.max(np.abs(residuals) / np.abs(y)))
    spread = float(np.sum((y - y.mean()) ** 2))
    r2 = float("nan") if exact or spread == 0 else 1.0 - float(np.sum(residuals**2)) / spread
    message = (
        "exact through 3 points: no residual to judge the model by; add lengths for least squares"
        if exact
        else f"least squares over {len(x)} points"
    )
    negative = [name for name, value in (("a", a), ("b", b), ("c", c)) if value < 0]
    if negative:
        message += (
            f"; {', '.join(negative)} < 0: that term is not resolved at these lengths (noise or "
            "too narrow a range); read the shares with care"
        )
    return QuadraticFit(
        a,
        b,
        c,
        n_points=int(len(x)),
        method=method,
        condition_number=condition,
        residual_rms_s=rms,
        max_rel_residual=rel,
        r_squared=r2,
        lengths=[int(v) for v in x],
        residuals_s=[float(r) for r in residuals],
        message=message,
    )


def term_shares(fit: QuadraticFit, length: float, measured_s: float) -> dict[str, float]:
    """Per length: a*T^2, b*T and c over the measured time (NaN when the fit is not usable)."""
    if not fit.usable or not math.isfinite(measured_s) or measured_s <= 0:
        nan = float("nan")
        return {"quadratic_share": nan, "linear_share": nan, "fixed_share": nan, "residual_s": nan}
    return {
        "quadratic_share": fit.a * length * length / measured_s,
        "linear_share": fit.b * length / measured_s,
        "fixed_share": fit.c / measured_s,
        "residual_s": measured_s - fit.predict(length),
    }


def fit_control(
    lengths: Sequence[int],
    shares: tuple[float, float, float] = (0.3, 0.5, 0.2),
    rel_tolerance: float = 1e-6,
) -> dict[str, Any]:
    """Positive control: timings made from known coefficients must be recovered by the same fit.

    Run at the stage's own lengths (same conditioning as the real fit) and, for the least-squares
    path, at those lengths plus two more with a known +/-1% perturbation that must leave a, b, c
    within a few percent and be reported as residuals.
    """
    base = sorted({int(v) for v in lengths})
    if len(base) < MIN_POINTS:
        base = [128, 256, 512]
    # Known coefficients scaled to the lengths, so each term is a real share of a 1 s step at
    # the longest length (a quadratic term lost in the noise would test nothing).
    longest = float(base[-1])
    a, b, c = shares[0] / longest**2, shares[1] / longest, shares[2]
    truth = np.array([a, b, c])
    exact_times = [a * t * t + b * t + c for t in base]
    exact = fit_step_time(base[:MIN_POINTS], exact_times[:MIN_POINTS])
    exact_err = float(np.max(np.abs(np.array([exact.a, exact.b, exact.c]) - truth) / truth))

    extended = base + [int(base[-1] * 1.5), int(base[-1] * 2)]
    wiggle = np.array([(-1) ** i * 0.01 for i in range(len(extended))])
    noisy_times = [(a * t * t + b * t + c) * (1 + w) for t, w in zip(extended, wiggle, strict=True)]
    lsq = fit_step_time(extended, noisy_times)
    lsq_err = float(np.max(np.abs(np.array([lsq.a, lsq.b, lsq.c]) - truth) / truth))
    lsq_tolerance = 0.25  # 1% noise on 5 points moves a, b, c by a few percent; 25% is generous

    passed = (
        exact.method == "exact"
        and exact_err <= rel_tolerance
        and lsq.method == "least_squares"
        and lsq_err <= lsq_tolerance
        and math.isfinite(lsq.residual_rms_s)
        and lsq.residual_rms_s > 0
    )
    return {
        "name": "scaling_fit_recovers_known_coefficients",
        "description": (
            "timings synthesised from known a, b, c at the run's lengths are fitted by the stage's "
            "own fit: exact with 3 points, least squares (with residuals) with 5 noisy points"
        ),
        "expected": {
            "a": a,
            "b": b,
            "c": c,
            "exact_rel_error_max": rel_tolerance,
            "least_squares_rel_error_max": lsq_tolerance,
        },
        "observed": {
            "lengths": base[:MIN_POINTS],
            "exact": {"a": exact.a, "b": exact.b, "c": exact.c, "rel_error": exact_err},
            "least_squares": {
                "lengths": extended,
                "a": lsq.a,
                "b": lsq.b,
                "c": lsq.c,
                "rel_error": lsq_err,
                "residual_rms_s": lsq.residual_rms_s,
                "condition_number": lsq.condition_number,
            },
        },
        "passed": bool(passed),
    }


# ---------------------------------------------------------------------------------------------
# Least squares with bootstrap intervals, over lengths taken from the data
# ---------------------------------------------------------------------------------------------

MIN_FIT_LENGTHS = 5
STATISTICS = {"median": np.median, "min": np.min}


@dataclass(frozen=True)
class BootstrapFit:
    """A least-squares fit over repeated timings, with percentile bootstrap intervals for a, b, c
    (repeats resampled within each length, so every replicate keeps the measured lengths)."""

    fit: QuadraticFit
    a_ci: tuple[float, float]
    b_ci: tuple[float, float]
    c_ci: tuple[float, float]
    resamples: int
    low: int  # the measured range: never price outside it
    high: int

    def as_row(self) -> dict[str, Any]:
        row = self.fit.as_row()
        for name in ("a", "b", "c"):
            low, high = getattr(self, f"{name}_ci")
            row[f"{name}_ci_low"] = low
            row[f"{name}_ci_high"] = high
        row.update(resamples=self.resamples, range_low=self.low, range_high=self.high)
        return row

    def in_range(self, length: float) -> bool:
        return self.low <= length <= self.high


def fit_with_intervals(
    lengths: Sequence[float],
    times_s: Sequence[float],
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
    statistic: str = "median",
) -> BootstrapFit:
    """Least squares (fit_step_time) through the median time of each length (robust to the rare
    preempted repeat; `statistic="min"` for a deterministic cost whose only noise is delay),
    plus bootstrap intervals for a, b, c: each replicate resamples the repeats within every
    length, takes their medians and refits."""
    x = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(times_s, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    reduce = STATISTICS[statistic]
    distinct = np.unique(x)
    groups = [y[x == value] for value in distinct]
    fit = fit_step_time(distinct, [float(reduce(g)) for g in groups])
    nan = (float("nan"), float("nan"))
    if not fit.usable:
        return BootstrapFit(fit, nan, nan, nan, 0, int(x.min(initial=0)), int(x.max(initial=0)))
    design, scale = _design(distinct)
    rng = np.random.default_rng(seed)
    coefficients = np.empty((resamples, 3))
    for r in range(resamples):
        medians = [float(reduce(rng.choice(g, size=g.size, replace=True))) for g in groups]
        scaled, *_ = np.linalg.lstsq(design, np.asarray(medians), rcond=None)
        coefficients[r] = scaled / scale
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(coefficients, [tail, 1.0 - tail], axis=0)
    return BootstrapFit(
        fit,
        (float(low[0]), float(high[0])),
        (float(low[1]), float(high[1])),
        (float(low[2]), float(high[2])),
        resamples,
        int(x.min()),
        int(x.max()),
    )


def default_fit_lengths(
    padded_lengths: Sequence[int],
    max_seq_len: int,
    n_points: int = MIN_FIT_LENGTHS,
    low_quantile: float = 0.1,
    shortest: int | None = None,
) -> list[int]:
    """Fit lengths from the data: quantiles of the padded micro-batch length from `low_quantile`
    up to max_seq_len (the longest a micro-batch can be), at least `n_points` distinct lengths
    (geometric fill between the ends where quantiles coincide). `shortest` (the shortest padded
    micro-batch of any plan) is added as one more point, so the measured range covers every
    micro-batch and the fit can price a whole plan without leaving it.

    When the data's lengths crowd the cap (a CPU run caps every length at
    ``replay.cpu.max_seq_len``, so the low quantile can land just under it; or a dataset of a
    few examples), the low end drops to ``max_seq_len // 8`` wherever it lies above half the cap:
    over a narrower range the fit cannot tell its three terms apart. The fit then spans more
    than the data, never less."""
    if n_points < MIN_POINTS:
        raise ValueError(f"n_points={n_points}: the fit needs at least {MIN_POINTS} lengths")
    values = np.asarray(padded_lengths, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        raise ValueError("no padded micro-batch length to take fit lengths from")
    quantiles = np.quantile(values, np.linspace(low_quantile, 1.0, n_points))
    low = max(int(round(quantiles[0])), 1)
    high = int(max_seq_len)
    if low > high // 2:  # under a factor of 2 the three terms are not told apart
        low = max(1, min(low, high // 8))
    points = {min(max(int(round(q)), low), high) for q in quantiles[:-1]} | {low, high}
    fill = n_points
    while len(points) < n_points and fill < 64 * n_points:
        points |= {int(round(v)) for v in np.geomspace(low, high, fill)}
        fill += 1
    if len(points) < n_points:
        raise FitLengthsError(
            f"cannot place {n_points} distinct fit lengths between {low} and {high}: raise the "
            "length cap the replay runs at (replay.cpu.max_seq_len on CPU, training.max_seq_len "
            "on a GPU), or set replay.fit.cpu_lengths / replay.fit.lengths"
        )
    if shortest is not None and 1 <= int(shortest) < min(points):
        points.add(int(shortest))
    return sorted(points)
