"""Replay's strata and allocation: strata are log-spaced bands of the tokens a micro-batch
computes over, so rare large micro-batches are sampled as often as common small ones (and
weighted, by probes.replay.estimate, by how many there really are); within a stratum a simple
random sample (a random order's prefix), grown where it cuts the variance most per second
(``grow_allocation``); which changes the budget can decide at all (``affordable_changes``) and
which get the next round (``strategy_weights``, ``widest_first``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import plans as pl


def stratum_edges(sizes: np.ndarray, n_strata: int) -> np.ndarray:
    """n_strata + 1 log-spaced edges spanning [min, max] of the sizes (one stratum if constant)."""
    low, high = float(np.min(sizes)), float(np.max(sizes))
    if n_strata < 1:
        raise ValueError(f"n_strata={n_strata}: need at least 1")
    if low <= 0:
        raise ValueError(f"stratum sizes must be positive (min {low})")
    if high <= low:
        return np.array([low, high])
    return np.geomspace(low, high, n_strata + 1)


def assign_strata(sizes: np.ndarray, n_strata: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratum index of every size (0-based, empty strata dropped) and the non-empty edges."""
    edges = stratum_edges(np.asarray(sizes, dtype=np.float64), n_strata)
    raw = np.clip(np.searchsorted(edges, sizes, side="right") - 1, 0, len(edges) - 2)
    used, index = np.unique(raw, return_inverse=True)
    return index.astype(np.int64), np.stack([edges[used], edges[used + 1]], axis=1)


MIN_PER_STRATUM = 2  # a stratum's residual spread needs two timed units


def stratum_orders(
    plan: pd.DataFrame, n_strata: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Every plan row's stratum, the strata bounds, and per stratum a random order of its
    members: the first n of an order is a simple random sample of n, and growing n keeps it one."""
    stratum, bounds = assign_strata(plan["computed_tokens"].to_numpy(dtype=np.float64), n_strata)
    orders = [rng.permutation(np.flatnonzero(stratum == h)) for h in range(len(bounds))]
    return stratum, bounds, orders


def grow_allocation(
    takes: dict[tuple[str, int], int],
    sizes: dict[tuple[str, int], int],
    spread: dict[tuple[str, int], float],
    weight: dict[str, float],
    extra: int,
    cost: dict[tuple[str, int], float] | None = None,
    twins: Mapping[tuple[str, int], tuple[tuple[str, int], float]] | None = None,
) -> dict[tuple[str, int], int]:
    """`extra` more units, one at a time where they cut Σ_s weight_s · V_s most per second of
    timing, V_s = Σ_h N_h² S_h² (1/n_h − 1/N_h) (Neyman's allocation by stratum size × spread,
    / √cost when a unit's timing cost differs, greedily, across strategies; weight carries 1/T_s²
    and how often a strategy's variance is counted). A stratum first gets MIN_PER_STRATUM (or
    all of it). `twins`: a paired change's stratum -> (the baseline's, the seconds of its unit):
    the change's units are a prefix of the baseline's order, so its `cost` (its own time and its
    twin's) drops by the twin's where the baseline already has that unit, and a unit that needs
    a new twin brings it."""
    out = dict(takes)
    for key, size in sizes.items():
        out[key] = max(out.get(key, 0), min(size, MIN_PER_STRATUM))
    twins = twins or {}
    for _ in range(extra):
        best, gain = None, 0.0
        for key, size in sizes.items():
            n = out[key]
            if n >= size:
                continue
            g = weight[key[0]] * size * size * spread[key] ** 2 * (1.0 / n - 1.0 / (n + 1))
            g /= next_unit_cost(key, out, cost, twins) if cost else 1.0
            if g > gain:
                best, gain = key, g
        if best is None:
            break
        out[best] += 1
        twin = twins.get(best)
        if twin is not None and out.get(twin[0], 0) < out[best]:
            out[twin[0]] = out[best]
    return out


def next_unit_cost(
    key: tuple[str, int],
    takes: Mapping[tuple[str, int], int],
    cost: Mapping[tuple[str, int], float],
    twins: Mapping[tuple[str, int], tuple[tuple[str, int], float]],
) -> float:
    """The seconds the next unit of `key` costs: without its twin's where the baseline already
    has the unit it pairs with (grow_allocation)."""
    twin = twins.get(key)
    if twin is not None and takes.get(twin[0], 0) > takes[key]:
        return max(cost[key] - twin[1], 1e-9)
    return cost[key]


# a unit's fixed cost before anything is timed, as a share of its plan's mean tokens
FIXED_SHARE = 0.2


def proxy_fixed(plan: pd.DataFrame) -> float:
    """The step's overhead in token units: FIXED_SHARE of the plan's mean computed + loss
    tokens."""
    cost = plan["computed_tokens"].to_numpy(np.float64) + plan["loss_tokens"].to_numpy(np.float64)
    return FIXED_SHARE * float(cost.mean())


def proxy_cost(plan: pd.DataFrame, stratum: np.ndarray) -> dict[int, float]:
    """Before anything is timed: a unit's timing cost per stratum in token units, its mean
    computed + loss tokens plus the plan's fixed share (proxy_fixed)."""
    cost = plan["computed_tokens"].to_numpy(np.float64) + plan["loss_tokens"].to_numpy(np.float64)
    fixed = proxy_fixed(plan)
    return {int(h): float(cost[stratum == h].mean()) + fixed for h in np.unique(stratum)}


def proxy_spread(plan: pd.DataFrame, stratum: np.ndarray, cv: float = 0.1) -> dict[int, float]:
    """Before anything is timed: a stratum's spread in computed-token units, its own spread of
    computed + loss tokens and an instrument noise of `cv` × its mean."""
    cost = plan["computed_tokens"].to_numpy(np.float64) + plan["loss_tokens"].to_numpy(np.float64)
    out = {}
    for h in np.unique(stratum):
        part = cost[stratum == h]
        out[int(h)] = math.sqrt(float(np.var(part)) + (cv * float(part.mean())) ** 2)
    return out


# sizing never goes below two strata: one stratum of 2 units per strategy (the trainer default on
# CPU) failed the replay's coverage control (0.868 of simulated runs covered, 0.9 needed)
MIN_SIZED_STRATA = 2


def first_round_seconds(
    plans: pd.DataFrame, n_strata: int, per_stratum: int, unit: tuple[float, float]
) -> float:
    """What round 1 with `n_strata` strata is predicted to take: `per_stratum` units (at least
    MIN_PER_STRATUM) of every stratum of every strategy (all of a smaller plan), as
    initial_takes grows it, each a new shape (timed once, warmed once: `unit` = seconds and
    computed + loss tokens of the instrument's micro-batch, a baseline one), scaled by the
    strategy's proxy cost (strata.proxy_cost) over the instrument's, both with the baseline
    plan's fixed share."""
    unit_s, unit_tokens = unit
    baseline = plans[plans["strategy"] == pl.BASELINE]
    instrument_cost = float(unit_tokens) + proxy_fixed(baseline if len(baseline) else plans)
    total = 0.0
    for _, plan in plans.groupby("strategy", sort=False):
        units = min(len(plan), max(per_stratum, MIN_PER_STRATUM) * n_strata)
        mean_cost = proxy_cost(plan, np.zeros(len(plan), dtype=np.int64))[0]
        total += units * unit_s * mean_cost / instrument_cost
    return total


def sized_strata(
    plans: pd.DataFrame, n_strata: int, per_stratum: int, unit: tuple[float, float], budget_s: float
) -> dict[str, Any]:
    """The most strata (at most `n_strata`, at least MIN_SIZED_STRATA unless fewer are
    configured) whose first round the budget affords (first_round_seconds; `unit`: seconds and
    tokens of a measured micro-batch with its warm-up). The first round always runs, so without
    this a slow step (a trainer's on CPU) spends several budgets before the first stop; with it:
    fewer strata, the same estimator, wider intervals. Returns what was sized ("strata"), and
    why."""
    unit_s, unit_tokens = unit
    configured = int(n_strata)
    strata = configured
    predicted = first_round_seconds(plans, strata, per_stratum, unit)
    while strata > MIN_SIZED_STRATA and predicted > budget_s:
        strata -= 1
        predicted = first_round_seconds(plans, strata, per_stratum, unit)
    return {
        "strata": strata,
        "strata_configured": configured,
        "first_round_predicted_s": predicted,
        "unit_s": float(unit_s),
        "unit_tokens": float(unit_tokens),
        "rule": "the most strata (<= configured, >= 2) whose first round (samples_per_stratum "
        "per stratum of every strategy, each micro-batch warmed once, priced by its tokens from "
        "a measured one) fits budget_s",
    }


# the t quantile a change's first intervals carry (few units: df ~ 3-5)
PLANNING_T = 2.8
# a unit's first timing of a new shape is warmed once: what a unit costs (on the default run
# on CPU nearly every unit of a round is a new shape: 48 units took 90 s at 0.9 s a timing)
WARMED_UNIT = 2.0


def units_to_resolve(cv: float, width: float, floor: int) -> int:
    """Units a change needs for a 95% saving interval `width` wide when each unit's relative
    noise is `cv` and the baseline's twin adds its own (√2): (2·t·√2·cv / width)², at least
    `floor` (the first round's)."""
    return max(int(floor), math.ceil((2 * PLANNING_T * math.sqrt(2) * cv / width) ** 2))


def affordable_changes(
    plans: pd.DataFrame,
    unit: tuple[float, float],
    cv: float,
    width: float,
    budget_s: float,
    floor: int,
    baseline: str,
    predicted: Mapping[str, float] | None = None,
    unit_seconds: Mapping[str, float] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Before timing, from exact counts and the measured instrument: the changes whose first
    round (`floor` units) the budget affords, the most promising first (the scaling fit's saving
    from each plan's exact shapes, `predicted`, else its exact computed-token saving; step-level
    changes on the same shapes after the batching changes predicted to save), a unit priced at
    `unit_seconds` (the scaling fit's), else by its tokens from a measured unit; the rest, each
    with what deciding it would take (units_to_resolve units). A change whose exact token saving
    is below `width` / 2 and which keeps the baseline's micro-batch count is never a batching
    win worth timing."""
    unit_s, unit_tokens = unit
    groups = dict(tuple(plans.groupby("strategy", sort=False)))
    base = groups[baseline]
    per_token = unit_s / max(float(unit_tokens) + proxy_fixed(base), 1e-9)
    need = units_to_resolve(cv, width, floor)
    base_tokens = float(base["computed_tokens"].sum())

    def seconds(name: str, units: int) -> float:
        known = (unit_seconds or {}).get(name, math.nan)
        if not (math.isfinite(known) and known > 0):
            known = per_token * proxy_cost(groups[name], np.zeros(len(groups[name]), np.int64))[0]
        return units * WARMED_UNIT * known

    saving = {n: 1 - float(g["computed_tokens"].sum()) / base_tokens for n, g in groups.items()}
    promise = {
        n: float(predicted[n]) if predicted and math.isfinite(predicted.get(n, math.nan)) else v
        for n, v in saving.items()
    }
    order = sorted((n for n in groups if n != baseline), key=lambda n: -promise[n])
    # a change is timed where its first round fits: the race then decides what it can, and the
    # instrument's few repeats make `need` a rough guide (on the default run 3.6% in one run,
    # 10.9% in the next: 4 units or 19)
    spent, kept, dropped = seconds(baseline, floor), [baseline], {}
    for name in order:
        cost = seconds(name, need)
        first = seconds(name, floor)
        same_count = len(groups[name]) == len(base)
        if 0 < abs(saving[name]) < width / 2 and same_count:
            dropped[name] = (
                f"not timed: its exact computed-token saving {saving[name]:.1%} is below what "
                f"timing resolves on this device (±{width / 2:.0%})"
            )
        elif spent + first > budget_s:
            dropped[name] = (
                f"not timed: deciding it at ±{width / 2:.0%} would take about {cost:.2g} s of "
                f"timing on this device ({need} units at a CV of {cv:.1%}); the budget "
                f"({budget_s:.3g} s) went to the changes its exact counts promise more"
            )
        else:
            spent += first
            kept.append(name)
    return kept, dropped


def strategy_weights(
    totals: Mapping[str, float],
    valid: Sequence[str],
    baseline: str = pl.BASELINE,
    others_weight: float = 0.25,
    paired: Collection[str] = (),
) -> dict[str, float]:
    """1/T² (relative variance), × the number of other valid unpaired strategies for the
    baseline (its variance enters each of their savings; a `paired` change's saving is its ratio
    on the same micro-batches, which the baseline's own sample does not narrow), × `others_weight`
    for a strategy not in `valid` (invalid anyway; 0 once decided)."""
    changes = [n for n in totals if n != baseline and n in valid]
    unpaired = sum(1 for n in changes if n not in paired)
    others = unpaired if changes else 1  # with no change to decide, the baseline's own
    weights = {}
    for name, total in totals.items():
        factor = others if name == baseline else (1.0 if name in valid else others_weight)
        weights[name] = factor / max(total, 1e-12) ** 2
    return weights


def widest_first(
    weights: Mapping[str, float],
    estimates: Mapping[str, Any],
    undecided: Sequence[str],
    baseline: str = pl.BASELINE,
    paired: Collection[str] = (),
) -> dict[str, float]:
    """Each undecided change's weight × its saving interval's width² (relative to the widest):
    the round goes first to the changes furthest from a decision, whatever their unit spreads
    (a checkpointing change at -28% [-99%, +18%] on 4 pairs got no unit of the next round on
    the default run while changes 20 pp wide got four). The baseline's weight (one share per
    unpaired change, strategy_weights) takes the mean of their factors: its units narrow those
    changes as far as their own widths call for (unscaled, it took 10-11 of the 12 units of the
    round after the first in the AVX2 runs, and every change kept its 4 units)."""
    widths = {
        n: estimates[n].saving_high - estimates[n].saving_low
        for n in undecided
        if n in estimates and math.isfinite(estimates[n].saving_high - estimates[n].saving_low)
    }
    widest = max(widths.values(), default=0.0)
    if widest <= 0:
        return dict(weights)
    factors = {n: (w / widest) ** 2 for n, w in widths.items()}
    users = [factors[n] for n in factors if n not in paired and n != baseline]
    out = {n: w * factors.get(n, 1.0) for n, w in weights.items()}
    if baseline in out and users:
        out[baseline] = weights[baseline] * sum(users) / len(users)
    return out
