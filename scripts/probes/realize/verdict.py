"""Promised vs realized: does a change's realized saving confirm the replay's promise, and if
not, which part of the step differed.

The verdict agrees when the realized saving lies inside the promised 95% interval and within
`agree_within` (±5 pp by default) of the promised saving; otherwise it disagrees.

What differed: the epoch time of each strategy splits into phases, the micro-batches' forward +
backward, the optimizer step (+ zero_grad), and the rest (building and moving the micro-batches
and what lies between them; the replay times none of it). For each phase, the saving the replay
would have promised had that phase alone been as realized, minus the promised saving, is the
phase's share of the difference, in percentage points; the phases at least `min_share_pp` from
zero are named, largest first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

AGREES, DISAGREES = "agrees", "disagrees"
BASELINE_ROLE, CHANGE_ROLE = "baseline", "change"
PHASES = ("micro_batch", "optimizer", "rest")
PHASE_NAMES = {
    "micro_batch": "per-micro-batch time",
    "optimizer": "optimizer time",
    "rest": "the rest of the step",
}


@dataclass(frozen=True)
class Phases:
    """A strategy's epoch time split by phase (seconds over the whole epoch)."""

    micro_batch: float
    optimizer: float
    rest: float

    @property
    def total(self) -> float:
        return self.micro_batch + self.optimizer + self.rest

    def with_phase(self, name: str, value: float) -> Phases:
        return Phases(**{**{p: getattr(self, p) for p in PHASES}, name: value})


def promised_phases(time_s: float, optimizer_steps: float, optimizer_step_s: float) -> Phases:
    """The replay's promise split: optimizer steps × its optimizer-step time, the rest is the
    micro-batches (the replay times nothing else). Unknown optimizer time: all micro-batches."""
    optimizer = optimizer_steps * optimizer_step_s
    if not math.isfinite(optimizer):
        optimizer = 0.0
    return Phases(time_s - optimizer, optimizer, 0.0)


def verdict(
    realized: float, promised: float, low: float, high: float, agree_within: float = 0.05
) -> str:
    """AGREES when `realized` is in [low, high] and within `agree_within` of `promised`."""
    values = (realized, promised, low, high)
    if not all(math.isfinite(v) for v in values):
        return DISAGREES
    inside = low <= realized <= high
    return AGREES if inside and abs(realized - promised) <= agree_within else DISAGREES


def saving(change: float, baseline: float) -> float:
    return 1.0 - change / baseline if baseline > 0 else math.nan


def phase_shares(
    promised_change: Phases,
    promised_baseline: Phases,
    realized_change: Phases,
    realized_baseline: Phases,
) -> dict[str, float]:
    """Per phase, in percentage points: the saving with that phase as realized (in both the
    change and the baseline, the others as promised) minus the promised saving."""
    promised = saving(promised_change.total, promised_baseline.total)
    shares = {}
    for name in PHASES:
        change = promised_change.with_phase(name, getattr(realized_change, name))
        base = promised_baseline.with_phase(name, getattr(realized_baseline, name))
        shares[name] = 100.0 * (saving(change.total, base.total) - promised)
    return shares


def what_differed(shares: Mapping[str, float], min_share_pp: float = 1.0) -> str:
    """The phases whose share of the difference is at least `min_share_pp`, largest first, as
    words ("optimizer time +7.9 pp; per-micro-batch time -1.2 pp"), or "" when none is."""
    named = sorted(
        (p for p in PHASES if abs(shares.get(p, 0.0)) >= min_share_pp),
        key=lambda p: -abs(shares[p]),
    )
    return "; ".join(f"{PHASE_NAMES[p]} {shares[p]:+.1f} pp" for p in named)
