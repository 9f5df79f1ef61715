"""Realize's sample and estimate: a simple random sample of a strategy's optimizer steps, each
timed whole, scaled to the epoch.

What is estimated: the epoch time T = Σ over all N optimizer steps of the step's wall time, from
n steps drawn by simple random sampling without replacement. Every step carries an auxiliary
known exactly for the whole epoch: what the replay promised for its micro-batches
(probes.realize.promise), or without a replay its size (the tokens they compute over). A
length-sorted strategy's steps differ by 10× in cost, and the plain mean of a few of them is
off by tens of percent, while realized / promised barely moves.

The step's micro-batches (forward and backward, 99% of a CPU step) are estimated by the ratio
estimator X ȳ / x̄ on their promise; the rest of the step (optimizer, zero_grad, building
batches: the same every step) by its mean (the ratio to 1); the two are added (`phase_sum`).
One ratio on the whole step would tilt wherever the realized constant differs from the
promised one: an optimizer 20 ms slower than promised, on steps of 10 to 100 ms, moved it 16 pp.

What the interval means: a 95% interval from the sampling variance of the residuals
e = y − R x with the finite-population correction, N² (1 − n/N) S_e² / n, and Student's t: the
spread an estimate from this many steps has. With two or three steps a strategy's own residuals
leave one or two degrees of freedom (t = 12.7, 4.3). So the residual is taken relative to the
auxiliary (e / (R x): one noise scale, the machine's and the instrument's) and pooled over
every strategy's sampled steps (`pooled_residual`, n − k degrees of freedom):
S_e² = R² σ² mean(x²) over the epoch's steps. σ² is the larger of the pooled one and the
strategy's own, so a strategy the promise follows less well keeps its wider spread. All N steps
sampled: the epoch's measured time (zero width). Like the replay's, it does not cover an error
shared by every step (another process's load).

The saving against the baseline, 1 − T_change / T_baseline, takes its interval from the delta
method on the log of the ratio of two independent estimates (t with the smaller df); the epoch's
own interval is on the log scale too: both are ratios or times, never below 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from probes.replay.greg import log_interval, t_quantile_975


def step_order(n_total: int, first: int, rng: np.random.Generator) -> np.ndarray:
    """A random order of the step indices 0..n_total−1, its first `first` in epoch order: any
    leading part of it is a simple random sample without replacement, so steps added later, a
    round at a time, keep the design."""
    if n_total < 1:
        raise ValueError("an epoch without an optimizer step: nothing to sample")
    order = rng.permutation(n_total)
    return np.concatenate([np.sort(order[:first]), order[first:]])


def sample_steps(n_total: int, n_sample: int, rng: np.random.Generator) -> np.ndarray:
    """`n_sample` of the step indices 0..n_total−1 drawn without replacement, in epoch order
    (all of them when the epoch has no more steps)."""
    return step_order(n_total, n_sample, rng)[:n_sample]


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
    """The t interval on the log scale (replay.greg.log_interval): an epoch takes a positive
    time, so its interval never reaches 0 however few steps were timed; a phase that took no
    time at all (total 0, no spread) is exactly 0."""
    low, high = log_interval(total, se, df) if total > 0 else (0.0, total + t_quantile_975(df) * se)
    return EpochEstimate(total, se, low, high, n, n_total, df, method)


def relative_residual(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y / (R x) − 1 with R = ȳ / x̄ (x̄ > 0); zero where every y is 0 (a phase that takes no
    time has no spread)."""
    ratio = float(y.mean() / x.mean())
    return y / (ratio * x) - 1.0 if ratio > 0 else np.zeros_like(y)


@dataclass(frozen=True)
class PooledResidual:
    """The relative residual variance σ² of every strategy's sampled steps about its own ratio,
    pooled, with its degrees of freedom (steps − strategies)."""

    variance: float
    df: int


def pooled_residual(
    samples: Iterable[tuple[Sequence[float], Sequence[float]]],
) -> PooledResidual | None:
    """σ² from (times, auxiliaries) of each strategy's sampled steps: Σ (y / (R x) − 1)² / (n − k),
    R = ȳ / x̄ per strategy; None without a degree of freedom."""
    squares, steps, groups = 0.0, 0, 0
    for times, aux in samples:
        y, x = np.asarray(times, dtype=np.float64), np.asarray(aux, dtype=np.float64)
        if y.size == 0 or float(x.mean()) <= 0:
            continue
        squares += float(np.sum(relative_residual(y, x) ** 2))
        steps, groups = steps + int(y.size), groups + 1
    df = steps - groups
    return PooledResidual(squares / df, df) if df >= 1 else None


def epoch_estimate(
    times: Sequence[float],
    n_total: int,
    aux: Sequence[float] | None = None,
    epoch_aux: Sequence[float] | None = None,
    pooled: PooledResidual | None = None,
) -> EpochEstimate:
    """The epoch time from the wall times of n steps drawn by SRS out of `n_total`.

    Without auxiliaries: N × the sample mean (t with n − 1 df). With each sampled step's
    auxiliary `aux` and every step's, `epoch_aux` (known exactly for the epoch): the ratio
    estimator X ȳ / x̄, its residual variance from `pooled` (relative, shared by every strategy)
    or else its own residuals (n − 1 df); either is finite-population corrected."""
    y = np.asarray(times, dtype=np.float64)
    n = int(y.size)
    if n == 0 or n > n_total:
        raise ValueError(f"{n} sampled steps out of {n_total}: need 1..{n_total}")
    fpc = 1.0 - n / n_total
    if n == n_total:
        total = float(y.sum())
        return EpochEstimate(total, 0.0, total, total, n, n_total, None, "every step")
    if aux is not None and epoch_aux is not None:
        x, population = np.asarray(aux, dtype=np.float64), np.asarray(epoch_aux, dtype=np.float64)
        if float(x.mean()) > 0:
            ratio = float(y.mean() / x.mean())
            total = ratio * float(population.sum())
            if pooled is not None:
                # the pooled variance is a floor: a strategy noisier than the rest keeps its own
                own = float(np.sum(relative_residual(y, x) ** 2)) / (n - 1) if n > 1 else 0.0
                variance = max(own, pooled.variance)
                s2 = ratio**2 * variance * float(np.mean(population**2))
                se = n_total * math.sqrt(fpc * s2 / n)
                return _interval(
                    total, se, pooled.df, n, n_total, "ratio estimator, pooled residual"
                )
            if n < 2:
                return EpochEstimate(
                    total, math.inf, -math.inf, math.inf, n, n_total, None, "one step"
                )
            e = y - ratio * x
            se = n_total * math.sqrt(fpc * float(e @ e) / (n - 1) / n)
            return _interval(total, se, n - 1, n, n_total, "ratio estimator")
    if n < 2:
        total = n_total * float(y.mean())
        return EpochEstimate(total, math.inf, -math.inf, math.inf, n, n_total, None, "one step")
    se = n_total * math.sqrt(fpc * float(y.var(ddof=1)) / n)
    return _interval(n_total * float(y.mean()), se, n - 1, n, n_total, "sample mean")


def phase_sum(micro: EpochEstimate, rest: EpochEstimate) -> EpochEstimate:
    """The epoch time as the micro-batch phase's estimate plus the rest of the step's (the
    optimizer and what lies between), each against an auxiliary of its own; their sampling
    errors added in quadrature (t with the smaller df)."""
    total = micro.total_s + rest.total_s
    if micro.df is None and rest.df is None:  # every step timed
        return EpochEstimate(
            total, 0.0, total, total, micro.sampled, micro.steps, None, micro.method
        )
    se = math.hypot(micro.se_s, rest.se_s)
    if not math.isfinite(se):
        return EpochEstimate(
            total, math.inf, -math.inf, math.inf, micro.sampled, micro.steps, None, "one step"
        )
    df = min(d for d in (micro.df, rest.df) if d is not None)
    return _interval(total, se, df, micro.sampled, micro.steps, micro.method)


def saving_estimate(change: EpochEstimate, baseline: EpochEstimate) -> tuple[float, float, float]:
    """(saving, low, high): 1 − T_change / T_baseline with a delta-method 95% interval."""
    ratio = change.total_s / baseline.total_s
    rel = math.hypot(change.se_s / change.total_s, baseline.se_s / baseline.total_s)
    dfs = [d for d in (change.df, baseline.df) if d is not None]
    if not dfs:
        return 1.0 - ratio, 1.0 - ratio, 1.0 - ratio
    # pooled estimates share one df (the same σ²); otherwise the smaller sample's; the time
    # ratio is positive, so its interval is on the log scale (no saving reaches 100%)
    low, high = log_interval(ratio, ratio * rel, max(min(dfs), 1))
    return 1.0 - ratio, 1.0 - high, 1.0 - low
