"""Reference pricing (replay.reference_every): the instrument's micro-batch timed again beside
the units, each unit priced in the reference's seconds, so a burst of load or drift over a few
seconds cancels like a pair's noise (an option for shared machines; off by default)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REFERENCE_RULE = (
    "the instrument's micro-batch timed again before every {every} units; each unit's time is "
    "priced in the reference's seconds: x the instrument's mean / the mean of the reference "
    "timings just before and after it (raw_times_s keeps the wall times)"
)


@dataclass(frozen=True)
class Reference:
    """The instrument's micro-batch, timed again before every `every` timed units: each unit is
    priced in the reference's seconds (reference_factors), so what the machine does over a few
    seconds (drift, another process's burst) cancels like a pair's noise. `mean_s`: the
    instrument's mean of it."""

    row: Any
    mean_s: float
    every: int


def reference_factors(
    positions: Sequence[int], marks: Sequence[tuple[int, float]], mean_s: float
) -> np.ndarray:
    """Per timing at `positions` (its place in the timed order), mean_s / the mean of the
    reference timings just before and just after it (`marks`: (place, seconds), a reference at
    place p timed before the unit at p); 1 where none could be timed."""
    places = np.asarray([p for p, v in marks if math.isfinite(v) and v > 0], dtype=np.float64)
    values = np.asarray([v for p, v in marks if math.isfinite(v) and v > 0], dtype=np.float64)
    out = np.ones(len(positions), dtype=np.float64)
    if not values.size or not (math.isfinite(mean_s) and mean_s > 0):
        return out
    for i, position in enumerate(positions):
        before = np.flatnonzero(places <= position)
        after = np.flatnonzero(places > position)
        near = [values[j[k]] for j, k in ((before, -1), (after, 0)) if j.size]
        out[i] = mean_s / float(np.mean(near))
    return out


def in_reference_seconds(
    times: Sequence[Sequence[float]],
    places: Sequence[Sequence[int]],
    marks: Sequence[tuple[int, float]],
    reference: Reference | None,
) -> list[list[float]]:
    """Each unit's timings in the reference's seconds (reference_factors); as timed where no
    reference was."""
    if reference is None:
        return [list(t) for t in times]
    flat = [p for unit in places for p in unit]
    factors = iter(reference_factors(flat, marks, reference.mean_s).tolist())
    return [[float(v) * next(factors) for v in unit] for unit in times]
