"""Realize's sample and estimate: a simple random sample of a strategy's optimizer steps, each
timed whole, scaled to the epoch.

What is estimated: the epoch time T = Σ over all N optimizer steps of the step's wall time, from
n steps drawn by simple random sampling without replacement. Every step's size (the tokens its
micro-batches compute over) is known exactly from the plan, so the estimate regresses the
sampled times on it (the regression estimator; the ratio estimator below 4 steps; N × the mean
without sizes): a length-sorted strategy's steps differ by 10× in cost, and the plain mean of a
few of them is off by tens of percent.

What the interval means: a 95% interval from the sampling variance of the residuals with the
finite-population correction, N² (1 − n/N) s_e² / n, and Student's t: the spread an estimate
from this many steps has. All N steps sampled: the epoch's measured time (zero width). Like
the replay's, it does not cover an error shared by every step (another process's load).

The saving against the baseline, 1 − T_change / T_baseline, takes its interval from the delta
method on the ratio of two independent estimates (t with the smaller sample's degrees of freedom).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Student's t 0.975 quantiles for 1..30 degrees of freedom (beyond: the normal 1.96).
T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z_975 = 1.959964


def t_quantile(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"df={df}: need at least 1 degree of freedom")
    return T_975[df - 1] if df <= len(T_975) else Z_975


def sample_steps(n_total: int, n_sample: int, rng: np.random.Generator) -> np.ndarray:
    """`n_sample` of the step indices 0..n_total−1 drawn without replacement, in epoch order
    (all of them when the epoch has no more steps)."""
    if n_total < 1:
        raise ValueError("an epoch without an optimizer step: nothing to sample")
    if n_sample >= n_total:
        return np.arange(n_total)
    return np.sort(rng.choice(n_total, size=n_sample, replace=False))


@dataclass(frozen=True)
class EpochEstimate:
    """The epoch time with its standard error, 95% interval and degrees of freedom (None:
    exact, every step timed)."""

    total_s: float
    se_s: float
    low_s: float
    high_s: float
    sampled: int
    steps: int
    df: int | None
    method: str


def _interval(total: float, se: float, df: int, n: int, n_total: int, method: str):
    """The t interval, its lower end at 0 (an epoch takes no negative time)."""
    half = t_quantile(df) * se
    return EpochEstimate(total, se, max(total - half, 0.0), total + half, n, n_total, df, method)


def epoch_estimate(
    times: Sequence[float],
    n_total: int,
    sizes: Sequence[float] | None = None,
    size_total: float | None = None,
) -> EpochEstimate:
    """The epoch time from the wall times of n steps drawn by SRS out of `n_total`.

    Without `sizes`: N × the sample mean. With each sampled step's size (its computed tokens)
    and the epoch's total size, known exactly for every step: the regression estimator
    N (ȳ + b (X̄ − x̄)) (n ≥ 4, t with n − 2 df) or, with fewer steps, the ratio estimator
    X ȳ / x̄ (t with n − 1 df); either has the finite-population-corrected variance of its
    residuals, and cuts the variance wherever step time follows the step's size."""
    y = np.asarray(times, dtype=np.float64)
    n = int(y.size)
    if n == 0 or n > n_total:
        raise ValueError(f"{n} sampled steps out of {n_total}: need 1..{n_total}")
    fpc = 1.0 - n / n_total
    if n == n_total:
        total = float(y.sum())
        return EpochEstimate(total, 0.0, total, total, n, n_total, None, "every step")
    if n < 2:
        total = n_total * float(y.mean())
        return EpochEstimate(total, math.inf, -math.inf, math.inf, n, n_total, None, "one step")
    if sizes is not None and size_total is not None:
        x = np.asarray(sizes, dtype=np.float64)
        mean_x = size_total / n_total
        if n >= 4 and float(x.var()) > 0:
            b = float(np.cov(x, y, ddof=1)[0, 1] / x.var(ddof=1))
            total = n_total * (float(y.mean()) + b * (mean_x - float(x.mean())))
            e = y - y.mean() - b * (x - x.mean())
            se = n_total * math.sqrt(fpc * float(e @ e) / (n - 2) / n)
            return _interval(total, se, n - 2, n, n_total, "regression on step size")
        if float(x.mean()) > 0:
            ratio = float(y.mean() / x.mean())
            e = y - ratio * x
            se = n_total * math.sqrt(fpc * float(e @ e) / (n - 1) / n)
            return _interval(ratio * size_total, se, n - 1, n, n_total, "ratio to step size")
    se = n_total * math.sqrt(fpc * float(y.var(ddof=1)) / n)
    return _interval(n_total * float(y.mean()), se, n - 1, n, n_total, "sample mean")


def saving_estimate(change: EpochEstimate, baseline: EpochEstimate) -> tuple[float, float, float]:
    """(saving, low, high): 1 − T_change / T_baseline with a delta-method 95% interval."""
    ratio = change.total_s / baseline.total_s
    rel = math.hypot(change.se_s / change.total_s, baseline.se_s / baseline.total_s)
    dfs = [d for d in (change.df, baseline.df) if d is not None]
    if not dfs:
        return 1.0 - ratio, 1.0 - ratio, 1.0 - ratio
    half = t_quantile(max(min(dfs), 1)) * ratio * rel
    # the time ratio is not negative, so no saving exceeds 100%
    return 1.0 - ratio, 1.0 - (ratio + half), 1.0 - max(ratio - half, 0.0)
