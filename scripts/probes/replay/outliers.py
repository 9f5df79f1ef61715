"""The replay's outlier screen: which timed units to time again, by their relative residuals
under the working model (probes.replay.greg) fitted over every strategy's units, and timing
them again (retime)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from probes.replay.greg import StrategyDesign, fit_working_model
from probes.step.timing import OK

if TYPE_CHECKING:
    from probes.replay.timing import ReplaySettings

# A unit timed once whose relative residual lies this many robust spreads (1.4826 × MAD) from
# the rest is timed twice more and priced at the median of its three timings: on the default CPU
# run one preempted micro-batch (+28%, the next largest +13%) took global_sort's interval from
# 6.8 to 14.1 pp wide; for normal noise 3.5 spreads flag 0.05% of units.
OUTLIER_SPREADS = 3.5
OUTLIER_TIMINGS = 3


def outlier_units(
    residuals: Mapping[str, np.ndarray], timings: Mapping[str, np.ndarray], cv: float
) -> dict[str, np.ndarray]:
    """Per strategy, the mask of its units to time again: relative residual (e/ŷ) beyond
    OUTLIER_SPREADS robust spreads (never inside the instrument's own 3 × CV), and fewer than
    OUTLIER_TIMINGS timings so far. The spread is all units', or the strategy's own where that is
    larger and it has 8 units: a strategy whose every unit is noisier than the rest carries noise,
    not outliers. Flagged against the others' spread, a third of its units were timed again and
    came back clean while its interval kept the width of the rest: the coverage control found
    padding-free eager covered in 0.67-0.78 of runs on the trainer bench (12% unit noise among
    strategies at 4-7%), 0.91 with its own spread."""
    pooled = np.concatenate([np.asarray(v, dtype=np.float64) for v in residuals.values()] or [[]])
    if pooled.size < 8:
        return {n: np.zeros(len(v), dtype=bool) for n, v in residuals.items()}
    centre, spread = float(np.median(pooled)), robust_spread(pooled)
    out = {}
    for name, relative in residuals.items():
        relative = np.asarray(relative, dtype=np.float64)
        own = robust_spread(relative) if relative.size >= 8 else 0.0
        limit = max(OUTLIER_SPREADS * max(spread, own), 3.0 * cv)
        out[name] = (np.abs(relative - centre) > limit) & (
            np.asarray(timings[name]) < OUTLIER_TIMINGS
        )
    return out


def flagged_units(designs: Mapping[str, StrategyDesign], cv: float) -> dict[str, np.ndarray]:
    """outlier_units over the strategies' timed units (their residuals by unit_residuals)."""
    return outlier_units(unit_residuals(designs), {n: d.timings for n, d in designs.items()}, cv)


def robust_spread(values: np.ndarray) -> float:
    """1.4826 × the median absolute deviation: a normal spread that outliers do not move."""
    values = np.asarray(values, dtype=np.float64)
    return 1.4826 * float(np.median(np.abs(values - np.median(values))))


def unit_residuals(designs: Mapping[str, StrategyDesign]) -> dict[str, np.ndarray]:
    """Each strategy's timed units' relative residuals e/ŷ under the working model fitted on
    every strategy's units together (as greg_estimate_all fits it), centred on the strategy's
    own median: a step-level change the shared model misprices (checkpointing's recompute,
    eager attention's L²) sat near the outlier limit as a whole, so its units with positive
    noise crossed it and were timed again while those with negative noise kept their one
    timing, and its estimate came out low (on the trainer bench 4-7 of padding-free eager's
    ~20 units and nearly every checkpointing unit were retimed, 1-2 of random's ~80)."""
    names = list(designs)
    x = np.concatenate([designs[n].x for n in names])
    y = np.concatenate([designs[n].y for n in names])
    model, _ = fit_working_model(x, y)
    out = {}
    for n in names:
        predicted = model.predict(designs[n].x)
        relative = (designs[n].y - predicted) / np.maximum(np.abs(predicted), 1e-12)
        out[n] = relative - (float(np.median(relative)) if relative.size else 0.0)
    return out


def retime(
    runner: Any, steps: pd.DataFrame, labels: pd.Index, settings: ReplaySettings
) -> tuple[pd.DataFrame, list[float]]:
    """Time the flagged units until each has OUTLIER_TIMINGS timings (one pass at a time, so
    their repeats are not back to back) and price each at the runner's statistic of them (the
    median); a unit whose timing fails (out of memory) keeps that status and is not retried."""
    from probes.replay.timing import run_sample  # torch: not for the estimator's light imports

    steps = steps.copy()
    optimizer: list[float] = []
    quiet = dataclasses.replace(settings, warmup=0)
    while len(labels):
        again, opt = run_sample(runner, steps.loc[labels], quiet)
        optimizer.extend(opt.tolist())
        for label in labels:
            for column in ("times_s", "raw_times_s"):
                if column in again:
                    steps.at[label, column] = list(steps.at[label, column]) + list(
                        again.at[label, column]
                    )
            if again.at[label, "status"] != OK:
                steps.at[label, "status"] = again.at[label, "status"]
        counts = steps.loc[labels, "times_s"].map(len)
        ok = steps.loc[labels, "status"] == OK  # a unit that failed again is not retried
        labels = counts.index[(counts < OUTLIER_TIMINGS) & ok]
    steps["timings"] = steps["times_s"].map(len)
    steps["time_s"] = [
        float(runner.reduce(t)) if s == OK and len(t) else float("nan")
        for t, s in zip(steps["times_s"], steps["status"], strict=True)
    ]
    return steps, optimizer
