"""Promised vs realized: does a change's realized saving confirm the replay's promise, and if
not, which part of the step differed.

Three words, one rule (``RULE``, stated once in the report):

- agrees: the realized saving's 95% interval meets the promised one, the realized saving lies
  within `agree_within` (±5 pp by default) of the promised saving, and its own interval is at
  most twice `agree_within` wide (narrow enough to tell a miss of that size). Meeting, not the
  realized point inside: a promise measured to a third of a point (an optimizer step priced in
  alternating turns) cannot hold a realized epoch's own spread of a point or two;
- disagrees: it fails that test and the difference of the two savings lies outside its own 95%
  interval (the two intervals' half-widths on the sides facing each other, added in
  quadrature): the two measurements differ. Each side's interval ruling out the other's saving
  is not that test: for two equal savings measured equally well it calls one in six a
  disagreement, not one in twenty (the trainer bench's padding-free eager, promised -19.8%
  [-24.8, -15.0], realized -14.8% [-18.8, -10.8]);
- undecided: anything else: the realized interval still holds the promise but is too wide to
  confirm it (too few steps), the promise is too wide to be checked to `agree_within` (its own
  interval holds the realized saving: a two-round bench run's 30 s replay promised 112 pp
  wide), or a figure is missing.

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
from typing import Any

AGREES, DISAGREES, UNDECIDED = "agrees", "disagrees", "undecided"
VERDICTS = (AGREES, DISAGREES, UNDECIDED)
RULE = (
    "**agrees**: the realized saving's 95% interval meets the promised one, the realized saving "
    "is within ±{pp:g} pp of the promised saving, and its own interval is at most {width:g} pp "
    "wide; **disagrees**: it fails that test and the two savings differ by more than the 95% "
    "interval of their difference (both intervals' half-widths added in quadrature); "
    "**undecided**: anything "
    "else (one side's interval holds the other's saving but is too wide to tell: too few real "
    "steps, or a promise too wide to check)"
)
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


def rule_text(agree_within: float = 0.05) -> str:
    """RULE with the configured tolerance filled in (the report states it once)."""
    return RULE.format(pp=100 * agree_within, width=200 * agree_within)


def too_wide(realized_low: Any, realized_high: Any, agree_within: float = 0.05) -> bool:
    """A realized interval wider than 2 × agree_within cannot tell a miss of agree_within; one
    with a bound missing (not a finite number) tells nothing."""
    bounds = (realized_low, realized_high)
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in bounds):
        return True
    return float(realized_high) - float(realized_low) > 2 * agree_within + 1e-12


def verdict(
    realized: float,
    promised: float,
    low: float,
    high: float,
    agree_within: float = 0.05,
    realized_low: float | None = None,
    realized_high: float | None = None,
) -> str:
    """AGREES, DISAGREES or UNDECIDED by RULE. `low`, `high`: the promised 95% interval;
    `realized_low`, `realized_high`: the realized one (without it, the realized point inside the
    promised interval and within `agree_within` AGREES, else DISAGREES: the two-way reading, kept
    for callers that lack it)."""
    values = (realized, promised, low, high)
    if not all(v is not None and math.isfinite(v) for v in values):
        return UNDECIDED
    close = abs(realized - promised) <= agree_within + 1e-12
    interval = (realized_low, realized_high)
    if not all(v is not None and math.isfinite(v) for v in interval):
        return AGREES if close and low <= realized <= high else DISAGREES
    r_low, r_high = interval
    hit = close and r_low <= high and low <= r_high  # the two intervals meet
    if hit and not too_wide(r_low, r_high, agree_within):
        return AGREES
    if not hit and differ(realized, r_low, r_high, promised, low, high):
        return DISAGREES
    return UNDECIDED


def differ(
    realized: float, r_low: float, r_high: float, promised: float, low: float, high: float
) -> bool:
    """Whether realized - promised lies outside its 95% interval: each side's half-width on the
    side facing the other (the intervals may be skewed: a ratio's), added in quadrature."""
    gap = realized - promised
    if gap >= 0:
        return gap > math.hypot(realized - r_low, high - promised)
    return -gap > math.hypot(r_high - realized, promised - low)


def verdict_of(row: Mapping[str, object], agree_within: float = 0.05) -> str:
    """The verdict of one change row of realize/realized.parquet (its columns), by RULE; a row
    whose sampled steps ran out of memory (its `note`) disagrees: the change did not train."""
    if row.get("note") and row.get("verdict") == DISAGREES:
        return DISAGREES

    def num(key: str) -> float:
        value = row.get(key)
        return float(value) if isinstance(value, int | float) else math.nan

    return verdict(
        num("realized_saving"),
        num("promised_saving"),
        num("promised_saving_ci_low"),
        num("promised_saving_ci_high"),
        agree_within,
        num("realized_saving_ci_low"),
        num("realized_saving_ci_high"),
    )


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
