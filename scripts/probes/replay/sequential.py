"""Replay's sequential design: simple random samples within each strategy's strata, timed in
rounds that interleave the strategies, grown where the variance is, until the decision is made
or the time budget is spent (``run_sequential``), and priced by the model-assisted estimator
(``probes.replay.greg.greg_estimate_all``).

Round 1 times at least `per_strategy` units of every strategy (MIN_PER_STRATUM of every stratum,
all of a smaller one, the rest by Neyman within the strategy); each later round adds
`round_size` units by stratum size × the residual spread just measured.
Later rounds time only the changes still undecided (greg.open_strategies: a race) and the
baseline beside them. Strategies on the baseline's own micro-batches (step-level changes that
keep them) are paired: the same micro-batches, timed back to back with the baseline's.
Stops: "decision" (every valid change decided), "budget" (not even a round of MIN_ROUND units
fits budget_s; the last round is as large as the budget still affords), "census" (nothing left
to time).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.replay.greg import (
    GregEstimate,
    StrategyDesign,
    auxiliaries,
    greg_estimate_all,
    open_strategies,
)
from probes.replay.outliers import OUTLIER_SPREADS, OUTLIER_TIMINGS, flagged_units, retime
from probes.replay.strata import (
    grow_allocation,
    proxy_cost,
    proxy_spread,
    sized_strata,
    strategy_weights,
    stratum_orders,
    widest_first,
)
from probes.replay.timing import MICRO_BATCH, ReplaySettings, run_sample
from probes.step.timing import OK

Key = tuple[str, int]
LOG = logging.getLogger("probes.replay")


@dataclass
class Design:
    plans: dict[str, pd.DataFrame]
    stratum: dict[str, np.ndarray]
    bounds: dict[str, np.ndarray]
    orders: dict[str, list[np.ndarray]]
    sizes: dict[Key, int]
    # strategies that run the baseline's own micro-batches (a step-level change that keeps
    # them): they share its strata and orders, so each of their units has a baseline twin
    paired: frozenset[str] = frozenset()

    @property
    def strategies(self) -> list[str]:
        return list(self.plans)


# what makes two plans the same micro-batches: the same examples, in the same layout and shape
SAME_MICRO_BATCHES = ("micro_batch_index", "layout", "rows", "padded_length", "computed_tokens")


def same_micro_batches(plan: pd.DataFrame, base: pd.DataFrame) -> bool:
    """Whether `plan` runs exactly `base`'s micro-batches (row by row)."""
    if len(plan) != len(base):
        return False
    columns = [c for c in SAME_MICRO_BATCHES if c in plan and c in base]
    if not plan[columns].reset_index(drop=True).equals(base[columns].reset_index(drop=True)):
        return False
    ids = [tuple(v) for v in plan["example_ids"]] if "example_ids" in plan else []
    return ids == ([tuple(v) for v in base["example_ids"]] if "example_ids" in base else [])


def build_design(plans: pd.DataFrame, n_strata: int, seed: int) -> Design:
    """Strata and random orders per strategy; the strategies on the baseline's own
    micro-batches share its strata and orders (paired)."""
    rng = np.random.default_rng(seed)
    frames, strata, bounds, orders, sizes, paired = {}, {}, {}, {}, {}, set()
    groups = dict(tuple(plans.groupby("strategy", sort=False)))
    base = groups.get(pl.BASELINE)
    base = base.reset_index(drop=True) if base is not None else None
    for name, group in groups.items():
        plan = group.reset_index(drop=True)
        if base is not None and name != pl.BASELINE and same_micro_batches(plan, base):
            paired.add(name)
            continue
        stratum, bound, order = stratum_orders(plan, n_strata, rng)
        frames[name], strata[name], bounds[name], orders[name] = plan, stratum, bound, order
    for name in paired:
        frames[name] = groups[name].reset_index(drop=True)
        strata[name], bounds[name] = strata[pl.BASELINE], bounds[pl.BASELINE]
        orders[name] = orders[pl.BASELINE]
    frames = {n: frames[n] for n in groups}
    for name, order in orders.items():
        for h, members in enumerate(order):
            sizes[(name, h)] = int(members.size)
    return Design(frames, strata, bounds, orders, sizes, frozenset(paired))


def plans_table(design: Design, names: Sequence[str] | None = None) -> pd.DataFrame:
    """The design's full plans (of `names`, else all) as timed: every micro-batch with its
    stratum and whether its strategy was paired with the baseline (replay_plans.parquet)."""
    frames = [
        design.plans[n].assign(stratum=design.stratum[n], paired=n in design.paired)
        for n in (names if names is not None else design.strategies)
    ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def with_twins(design: Design, takes: Mapping[Key, int]) -> dict[Key, int]:
    """`takes` with the baseline's grown to cover every paired change's units in each stratum
    (they share one order, so a change's units are a prefix of the baseline's)."""
    out = dict(takes)
    for name in design.paired:
        for (n, h), v in takes.items():
            if n == name:
                out[(pl.BASELINE, h)] = max(out.get((pl.BASELINE, h), 0), v)
    return out


def initial_takes(
    design: Design, valid: Sequence[str], extra: int, per_strategy: int = 0
) -> dict[Key, int]:
    """Round 1: every strategy at least `per_strategy` units (all of a smaller plan), spread over
    its own strata by Neyman; then `extra` more wherever they pay most across strategies."""
    spread, totals, cost = {}, {}, {}
    for name, plan in design.plans.items():
        proxy = proxy_spread(plan, design.stratum[name])
        costs = proxy_cost(plan, design.stratum[name])
        for h, s in proxy.items():
            spread[(name, h)] = s
            cost[(name, h)] = costs[h]
        totals[name] = float((plan["computed_tokens"] + plan["loss_tokens"]).sum())
    weights = strategy_weights(totals, valid)
    takes: dict[Key, int] = {}
    for name in design.plans:
        mine = {k: v for k, v in design.sizes.items() if k[0] == name}
        floor = sum(min(v, 2) for v in mine.values())
        grown = grow_allocation({}, mine, spread, weights, max(per_strategy - floor, 0), cost)
        takes.update(grown)
    return with_twins(design, grow_allocation(takes, design.sizes, spread, weights, extra, cost))


def first_round(design: Design, per_strategy: int, seed: int) -> pd.DataFrame:
    """Round 1 alone (initial_takes, every strategy at least `per_strategy` units), in its run
    order: the positive control's sample (probes.replay.control) is the race's first round."""
    units = new_units(
        design, initial_takes(design, design.strategies, 0, per_strategy), {},
        np.random.default_rng(seed + 11),
    )  # fmt: skip
    return units.assign(run_order=np.arange(len(units)))


def unit_costs(design: Design, steps: pd.DataFrame) -> dict[Key, float]:
    """Seconds a unit of each stratum took to time (its mean; the overall mean where none); a
    paired change's unit with its baseline twin's, which it needs beside it unless the baseline
    has it already (strata.grow_allocation's twins)."""
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == OK)]
    means = ok.groupby(["strategy", "stratum"])["time_s"].mean().to_dict()
    overall = float(ok["time_s"].mean()) if len(ok) else 1.0
    own = {key: max(float(means.get(key, overall)), 1e-9) for key in design.sizes}
    return {
        (name, h): cost + (own.get((pl.BASELINE, h), 0.0) if name in design.paired else 0.0)
        for (name, h), cost in own.items()
    }


def new_units(
    design: Design, takes: Mapping[Key, int], done: Mapping[Key, int], rng: np.random.Generator
) -> pd.DataFrame:
    """The rows to time to go from `done` to `takes`, interleaved: round-robin over blocks in a
    fresh random order each cycle, so drift is shared. A block is one unpaired strategy's unit,
    or a baseline micro-batch with every paired change's unit of the same micro-batch, back to
    back in a random order (their difference then shares the moment's noise)."""
    queues: dict[str, list[pd.DataFrame]] = {}
    for (name, h), n in takes.items():
        start = done.get((name, h), 0)
        if n <= start:
            continue
        picked = design.orders[name][h][start:n]
        rows = design.plans[name].iloc[picked].copy()
        rows["plan_row"] = picked
        rows["stratum"] = h
        rows["stratum_size"] = design.sizes[(name, h)]
        rows["stratum_low_tokens"] = design.bounds[name][h, 0]
        rows["stratum_high_tokens"] = design.bounds[name][h, 1]
        queues.setdefault(name, []).append(rows)
    if not queues:
        return pd.DataFrame()
    frames = {n: pd.concat(q) for n, q in queues.items()}
    twins = {n: f for n, f in frames.items() if n in design.paired}
    lanes = {n: f.sample(frac=1.0, random_state=rng) for n, f in frames.items() if n not in twins}
    blocks = {n: [[f.iloc[[i]]] for i in range(len(f))] for n, f in lanes.items()}
    beside = set()
    for i, block in enumerate(blocks.get(pl.BASELINE, [])):  # each twin beside its baseline unit
        row = int(block[0]["plan_row"].iloc[0])
        beside.add(row)
        block.extend(f[f["plan_row"] == row] for f in twins.values())
        blocks[pl.BASELINE][i] = [block[j] for j in rng.permutation(len(block))]
    for name, f in twins.items():  # a twin whose baseline unit an earlier round timed: alone
        alone = f[~f["plan_row"].isin(beside)].sample(frac=1.0, random_state=rng)
        if len(alone):
            blocks[name] = [[alone.iloc[[i]]] for i in range(len(alone))]
    position, ordered = dict.fromkeys(blocks, 0), []
    while blocks:
        for name in rng.permutation(sorted(blocks)):
            ordered.extend(blocks[name][position[name]])
            position[name] += 1
            if position[name] >= len(blocks[name]):
                del blocks[name]
    return pd.concat(ordered, ignore_index=True)


def strategy_designs(design: Design, steps: pd.DataFrame) -> dict[str, StrategyDesign]:
    """The estimator's input from the timed micro-batches (OK rows) of every strategy."""
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == OK)]
    out = {}
    for name in design.strategies:
        plan = design.plans[name]
        mine = ok[ok["strategy"] == name]
        if mine.empty:
            continue
        out[name] = StrategyDesign(
            plan_x=auxiliaries(plan),
            plan_stratum=design.stratum[name],
            optimizer_steps=int(plan["optimizer_step_index"].nunique()),
            stratum=mine["stratum"].to_numpy(np.int64),
            x=auxiliaries(mine),
            y=mine["time_s"].to_numpy(np.float64),
            timings=mine["timings"].to_numpy(np.float64)
            if "timings" in mine
            else np.ones(len(mine)),
            units=mine["plan_row"].to_numpy(np.int64) if "plan_row" in mine else None,
            paired=name in design.paired
            and "plan_row" in mine
            and pl.BASELINE in set(ok["strategy"]),
        )
    return out


def spreads_from(
    design: Design, estimates: Mapping[str, GregEstimate], steps: pd.DataFrame, cv: float
) -> dict[Key, float]:
    """Residual spread per stratum where two units were timed, else cv × the stratum's mean."""
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == OK)]
    means = ok.groupby(["strategy", "stratum"])["time_s"].mean().to_dict()
    overall = float(ok["time_s"].mean()) if len(ok) else 1.0
    out = {}
    for key in design.sizes:
        name, h = key
        measured = estimates[name].strata_residual_sd.get(h) if name in estimates else None
        floor = cv * means.get(key, overall)
        out[key] = max(measured if measured is not None else 0.0, floor, 1e-9)
    return out


def outlier_index(design: Design, steps: pd.DataFrame, cv: float) -> pd.Index:
    """Index labels (in `steps`) of the timed units outliers.outlier_units flags."""
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == OK)]
    designs = strategy_designs(design, steps)
    if not designs:
        return pd.Index([])
    flagged = flagged_units(designs, cv)
    return pd.Index(np.concatenate([ok.index[ok["strategy"] == n][flagged[n]] for n in designs]))


@dataclass(frozen=True)
class SequentialResult:
    steps: pd.DataFrame
    optimizer_times: np.ndarray
    estimates: dict[str, GregEstimate]
    record: dict[str, Any]
    takes: dict[Key, int]


def run_sequential(
    runner: Any,
    design: Design,
    settings: ReplaySettings,
    valid: Sequence[str],
    cv: float,
    cv_df: float,
    budget_s: float,
    round_size: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = False,
    per_strategy: int = 0,
) -> SequentialResult:
    """Time rounds until decided, out of budget or census (module docstring)."""
    rng = np.random.default_rng(settings.seed + 11)
    started = clock()
    takes = initial_takes(design, valid, 0, per_strategy)
    done: dict[Key, int] = {}
    timed = TimedRounds()
    stopped_by = "census"
    estimates: dict[str, GregEstimate] = {}
    first_round_s = float("nan")
    while True:
        units = new_units(design, takes, done, rng)
        if units.empty:
            stopped_by = "census"
            break
        time_round(runner, design, units, settings, timed, cv, progress)
        if timed.rounds == 1:  # what the sizing predicted (strata.sized_strata), measured
            first_round_s = float(clock() - started)
        done = dict(takes)
        estimates, _ = greg_estimate_all(
            strategy_designs(design, timed.steps), np.asarray(timed.optimizer), cv, cv_df
        )
        undecided = open_strategies(estimates, valid, settings.decide_within, settings.max_width)
        if not undecided:
            stopped_by = "decision" if len(valid) > 1 else "nothing to decide"
            break
        size = affordable_round(clock() - started, len(timed.steps), budget_s, round_size)
        if size == 0:
            stopped_by = "budget"
            break
        takes = next_takes(design, done, estimates, timed.steps, cv, undecided, size)
    steps = timed.steps.reset_index(drop=True)
    steps["run_order"] = np.arange(len(steps))
    record = {
        "stopped_by": stopped_by,
        "rounds": timed.rounds,
        "timed_micro_batches": int(len(steps)),
        "elapsed_s": float(clock() - started),
        "first_round_s": first_round_s,
        "budget_s": float(budget_s),
        "round_size": int(round_size),
        "initial_per_strategy": int(per_strategy),
        "retimed_micro_batches": len(set(timed.retimed)),
        "retimed_rule": RETIMED_RULE,
        "takes": {f"{n}/{h}": int(v) for (n, h), v in sorted(done.items())},
        "rule": STOPPING_RULE,
    }
    return SequentialResult(
        steps, np.asarray(timed.optimizer, dtype=np.float64), estimates, record, done
    )


# a last round smaller than this is not run: a paired unit and its twin
MIN_ROUND = 2


def affordable_round(elapsed_s: float, timed: int, budget_s: float, round_size: int) -> int:
    """The next round's units: `round_size`, or as many as the budget still affords at the
    race's own seconds per timed micro-batch (its warm-ups and overhead included) where that is
    fewer; 0 under MIN_ROUND. Stopping at the first round that does not fit whole left up to a
    round's seconds unspent (9 s of 82 on the default run on CPU: ten micro-batches)."""
    per_unit = elapsed_s / max(timed, 1)
    left = int((budget_s - elapsed_s) / per_unit) if per_unit > 0 else round_size
    size = min(round_size, left)
    return size if size >= MIN_ROUND else 0


def race(
    runner: Any,
    plans: pd.DataFrame,
    settings: ReplaySettings,
    valid: Sequence[str],
    noise: tuple[float, float],
    timing: tuple[tuple[float, float], float, int, int],
    progress: bool = False,
) -> tuple[Design, SequentialResult]:
    """The design sized to the budget (strata.sized_strata) and raced (run_sequential): `noise` the
    instrument's CV and its df, `timing` the measured unit (seconds, tokens), the budget in
    seconds, the round size and the design's seed. The first round's sizing is in the record."""
    unit, budget_s, round_size, seed = timing
    sizing = sized_strata(plans, settings.n_strata, settings.samples_per_stratum, unit, budget_s)
    design = build_design(plans, sizing["strata"], seed)
    if sizing["strata"] < sizing["strata_configured"]:
        LOG.info("first round: %d of %d strata per strategy (predicted %.0f s; budget %.0f s)",
                 sizing["strata"], sizing["strata_configured"],
                 sizing["first_round_predicted_s"], budget_s)  # fmt: skip
    result = run_sequential(
        runner, design, settings, valid, noise[0], noise[1], budget_s, round_size,
        progress=progress, per_strategy=sizing["strata"] * settings.samples_per_stratum,
    )  # fmt: skip
    result.record["first_round"] = sizing
    LOG.info("replayed %d micro-batches in %d round(s), stopped by %s", len(result.steps),
             result.record["rounds"], result.record["stopped_by"])  # fmt: skip
    return design, result


RETIMED_RULE = (
    f"a unit whose relative residual (centred on its strategy's median) lies over "
    f"{OUTLIER_SPREADS} robust spreads (1.4826 x MAD) from the others, and over 3 x the "
    f"instrument's CV, is timed until "
    f"it has {OUTLIER_TIMINGS} timings and priced at their median"
)
STOPPING_RULE = (
    "later rounds time only the undecided changes (a change is decided when its 95% saving "
    "interval excludes 0 or lies within +-decide_within, and is at most max_width wide); stop "
    "when every valid change is decided, or when not even a round of 2 units fits budget_s (the "
    "last round as large as the budget still affords)"
)


@dataclass
class TimedRounds:
    """What the rounds have timed so far: every micro-batch's row, the optimizer timings, the
    labels retimed as outliers and the number of rounds."""

    steps: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    optimizer: list[float] = dataclasses.field(default_factory=list)
    retimed: list[int] = dataclasses.field(default_factory=list)
    rounds: int = 0


def time_round(
    runner: Any,
    design: Design,
    units: pd.DataFrame,
    settings: ReplaySettings,
    timed: TimedRounds,
    cv: float,
    progress: bool = False,
) -> None:
    """Time one round's `units` (warm-up only in the first round) into `timed`, then retime the
    units the outlier rule flags over everything timed so far."""
    round_settings = settings if timed.rounds == 0 else dataclasses.replace(settings, warmup=0)
    steps, opt = run_sample(runner, units, round_settings, progress=progress)
    steps["round"] = timed.rounds
    steps["timings"] = steps["times_s"].map(len)
    timed.optimizer.extend(opt.tolist())
    timed.rounds += 1
    if timed.steps.empty:
        timed.steps = steps
    else:
        timed.steps = pd.concat([timed.steps, steps], ignore_index=True)
    flagged = outlier_index(design, timed.steps, cv)
    if len(flagged):
        timed.steps, opt = retime(runner, timed.steps, flagged, settings)
        timed.optimizer.extend(opt)
        timed.retimed.extend(int(v) for v in flagged)


def next_takes(
    design: Design,
    done: Mapping[Key, int],
    estimates: Mapping[str, GregEstimate],
    steps: pd.DataFrame,
    cv: float,
    undecided: Sequence[str],
    round_size: int,
) -> dict[Key, int]:
    """The next round's allocation: `round_size` more units where they pay most, by each
    stratum's size × the residual spread just measured, per second of timing, among the
    undecided changes (`undecided`) and the baseline beside them (as much as the unpaired ones
    need it; a paired change's units bring their twins)."""
    totals = {n: e.time_s for n, e in estimates.items()}
    weights = widest_first(
        strategy_weights(totals, undecided, others_weight=0.0, paired=design.paired),
        estimates,
        undecided,
        paired=design.paired,
    )
    spreads = spreads_from(design, estimates, steps, cv)
    costs = unit_costs(design, steps)
    twins = {
        (name, h): ((pl.BASELINE, h), costs[(pl.BASELINE, h)])
        for (name, h) in design.sizes
        if name in design.paired and (pl.BASELINE, h) in costs
    }
    grown = grow_allocation(done, design.sizes, spreads, weights, round_size, costs, twins)
    return with_twins(design, grown)
