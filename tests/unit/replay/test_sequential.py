"""The sequential design: Neyman allocation by stratum size × spread, strategies interleaved,
and the stopping rule (decision, budget, census) on a runner of known cost (no clock)."""

import numpy as np
import pandas as pd
import pytest
import torch

from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.contracts import TRAINING_STATUSES
from probes.replay.coverage import SimulatedCost
from probes.replay.sequential import affordable_round, build_design, new_units, run_sequential
from probes.replay.strata import first_round_seconds, grow_allocation, sized_strata
from probes.replay.timing import ReplaySettings, instrument_unit

MICRO, ACCUM, MAX_LEN = 2, 4, 64


@pytest.fixture(scope="module")
def plans() -> pd.DataFrame:
    frame = bucket_controls.synthetic_lengths_frame(600, seed=4, max_seq_len=MAX_LEN)
    used = frame[frame["status"].isin(TRAINING_STATUSES)]
    lengths = used["n_tokens"].to_numpy(np.int64)
    loss = np.where(np.arange(lengths.size) % 3 == 0, 0, lengths // 2)
    examples = pl.PlanExamples(used["example_id"].to_numpy(object), lengths, loss)
    return pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, bucket_size_batches=16, seed=0)


def test_allocation_follows_size_times_spread():
    sizes = {("s", 0): 100, ("s", 1): 100, ("s", 2): 3}
    spread = {("s", 0): 1.0, ("s", 1): 3.0, ("s", 2): 50.0}
    takes = grow_allocation({}, sizes, spread, {"s": 1.0}, extra=34)
    assert takes[("s", 2)] == 3  # all of a small stratum, never more
    assert sum(takes.values()) == 40
    assert takes[("s", 1)] / takes[("s", 0)] == pytest.approx(3.0, rel=0.2)  # Neyman: N·S
    assert grow_allocation({}, {("s", 0): 1}, {("s", 0): 1.0}, {"s": 1.0}, 5) == {("s", 0): 1}


def test_a_paired_unit_whose_twin_is_timed_costs_only_its_own_time():
    """A paired change's units are a prefix of the baseline's: where the baseline already has
    the unit a pair needs, the pair costs its own time, not its twin's too (run18: the widest
    change, checkpointing on 4 pairs, got none of the 12 units after round 1, the baseline 7)."""
    sizes = {("base", 0): 100, ("pair", 0): 100}
    spread = {("base", 0): 1.0, ("pair", 0): 1.0}
    weight = {"base": 1.0, "pair": 1.0}
    cost = {("base", 0): 1.0, ("pair", 0): 2.0}  # its own second and its twin's
    done = {("base", 0): 8, ("pair", 0): 2}
    twins = {("pair", 0): (("base", 0), 1.0)}
    priced_whole = grow_allocation(done, sizes, spread, weight, 6, cost)
    with_twins_timed = grow_allocation(done, sizes, spread, weight, 6, cost, twins)
    assert with_twins_timed[("pair", 0)] > priced_whole[("pair", 0)]
    # past the baseline, each new pair brings its twin (not counted in the round's units)
    ahead = grow_allocation({("base", 0): 2, ("pair", 0): 2}, sizes, spread, weight, 4, cost, twins)
    assert ahead[("base", 0)] >= ahead[("pair", 0)]


def test_new_units_interleave_strategies_and_never_repeat(plans):
    design = build_design(plans, 3, seed=0)
    takes = {key: min(size, 2) for key, size in design.sizes.items()}
    rng = np.random.default_rng(0)
    first = new_units(design, takes, {}, rng)
    n = len(design.strategies)
    assert set(first["strategy"].iloc[:n]) == set(design.strategies)  # one of each, then again
    more = {key: min(size, 3) for key, size in design.sizes.items()}
    second = new_units(design, more, takes, rng)
    both = pd.concat([first, second])
    assert not both.duplicated(["strategy", "micro_batch_index"]).any()
    assert len(second) == sum(more.values()) - sum(takes.values())


def test_a_paired_change_whose_baseline_twins_ran_earlier_is_still_timed(plans):
    """A later round that grows only a paired change (its baseline units timed in an earlier
    round, the race done with the baseline) times the change's new units on their own: they
    were dropped (never timed yet counted as done), and a round of nothing else crashed the
    bench ('No objects to concatenate')."""
    change = plans[plans["strategy"] == pl.BASELINE].assign(strategy="gradient_checkpointing_on")
    design = build_design(pd.concat([plans, change], ignore_index=True), 2, seed=0)
    assert design.paired == {"gradient_checkpointing_on"}
    done = {k: min(v, 3 if k[0] == pl.BASELINE else 2) for k, v in design.sizes.items()}
    takes = {k: min(v, 3) if k[0] == "gradient_checkpointing_on" else n
             for (k, v), n in zip(design.sizes.items(), done.values(), strict=True)}  # fmt: skip
    units = new_units(design, takes, done, np.random.default_rng(0))
    grown = sum(takes.values()) - sum(done.values())
    assert grown > 0 and len(units) == grown
    assert set(units["strategy"]) == {"gradient_checkpointing_on"}


def test_the_first_round_gets_the_most_strata_its_budget_affords(plans):
    strategies = plans["strategy"].nunique()
    tokens = plans["computed_tokens"] + plans["loss_tokens"]
    mean = float(tokens.mean())
    # a unit of the plans' mean tokens prices every strategy near unit_s: 6 units each at 3 strata
    assert first_round_seconds(plans, 3, 2, (1.0, mean)) == pytest.approx(strategies * 6, rel=0.5)
    # samples_per_stratum units a stratum, as initial_takes grows round 1 (4 on a GPU)
    assert first_round_seconds(plans, 3, 4, (1.0, mean)) == pytest.approx(
        2 * first_round_seconds(plans, 3, 2, (1.0, mean)), rel=0.05
    )
    assert sized_strata(plans, 3, 2, (0.5, mean), budget_s=1e6)["strata"] == 3
    # two strata fit a budget that three do not; the record says what was predicted
    tight = first_round_seconds(plans, 2, 2, (0.5, mean)) * 1.01
    assert first_round_seconds(plans, 3, 2, (0.5, mean)) > tight
    record = sized_strata(plans, 3, 2, (0.5, mean), budget_s=tight)
    assert record["strata"] == 2 and record["strata_configured"] == 3
    assert record["first_round_predicted_s"] <= tight
    # never fewer than two (one failed the coverage control): the first round always runs
    assert sized_strata(plans, 3, 2, (100.0, mean), budget_s=1.0)["strata"] == 2
    # an instrument that did not time sizes nothing
    assert sized_strata(plans, 3, 2, (0.0, 1.0), budget_s=1.0)["strata"] == 3


def test_the_instrument_prices_a_new_shape_with_its_warm_up():
    measured = {"mean_s": 0.5, "micro_batch": {"rows": 2, "padded_length": 64, "loss_tokens": 30}}
    assert instrument_unit(measured) == (1.0, 158.0)  # its shape had run: one more mean
    assert instrument_unit({**measured, "warmup_times_s": [0.7]}) == (1.2, 158.0)
    # a new shape is warmed once in the replay, however many warm-ups the instrument took
    assert instrument_unit({**measured, "warmup_times_s": [0.7, 0.6]}) == (1.2, 158.0)
    assert instrument_unit({"mean_s": float("nan"), "micro_batch": {}}) == (0.0, 1.0)


class KnownCostRunner:
    """What run_sample needs of a ReplayRunner, 'timing' a known cost with seeded noise."""

    device = torch.device("cpu")
    repeats = 1
    reduce = staticmethod(np.median)

    def __init__(self, cost: SimulatedCost, cv: float, clock: list[float]) -> None:
        self.cost, self.cv, self.clock = cost, cv, clock
        self.rng = np.random.default_rng(0)

    def warm_up(self, row) -> None:
        pass

    def warm_new_shapes(self, sample) -> int:
        return 0

    def time_micro_batch(self, row, busy=False):
        frame = pd.DataFrame([row._asdict()])
        seconds = float(self.cost.micro_batch_s(frame)[0]) * (1 + self.cv * self.rng.normal())
        self.clock[0] += seconds
        return {"status": "OK", "time_s": seconds, "times_s": [seconds], "gpu_busy_share": np.nan}

    def time_optimizer_step(self) -> float:
        self.clock[0] += self.cost.optimizer_s
        return self.cost.optimizer_s


def _run(plans, cv, budget_s):
    design = build_design(plans, 3, seed=0)
    clock = [0.0]
    runner = KnownCostRunner(SimulatedCost.scaled_to(plans), cv, clock)
    settings = ReplaySettings(3, 2, 100, ACCUM, seed=0, warmup=0, busy_samples_per_stratum=0)
    return run_sequential(
        runner,
        design,
        settings,
        list(design.strategies),
        cv,
        4.0,
        budget_s,
        12,
        clock=lambda: clock[0],
    )


def test_stops_on_the_budget_when_undecided(plans):
    result = _run(plans, cv=0.3, budget_s=40.0)
    assert result.record["stopped_by"] == "budget"
    assert result.record["rounds"] >= 2 and result.record["elapsed_s"] <= 40.0 + 10
    # the first round's own wall time, beside what strata.sized_strata predicted for it (the report)
    assert 0 < result.record["first_round_s"] < result.record["elapsed_s"]
    assert len(result.steps) == result.record["timed_micro_batches"] == sum(result.takes.values())


def test_the_last_round_is_as_large_as_the_budget_still_affords():
    # 40 micro-batches in 40 s: 1 s each, warm-ups and overhead included
    assert affordable_round(40.0, 40, budget_s=100.0, round_size=12) == 12
    assert affordable_round(40.0, 40, budget_s=47.5, round_size=12) == 7
    assert affordable_round(40.0, 40, budget_s=41.9, round_size=12) == 0  # not even a pair
    assert affordable_round(40.0, 40, budget_s=30.0, round_size=12) == 0


def test_stops_on_the_decision_when_the_timings_are_exact(plans):
    result = _run(plans, cv=0.0, budget_s=1e6)
    assert result.record["stopped_by"] == "decision", result.record["rounds"]
    assert result.record["rounds"] <= 4


class SpikyRunner(KnownCostRunner):
    """A known-cost runner whose `spiked` micro-batches come out 30% slow the first time only:
    a preempted timing."""

    def __init__(self, cost, clock, spiked):
        super().__init__(cost, 0.0, clock)
        self.spiked, self.seen = set(spiked), set()

    def time_micro_batch(self, row, busy=False):
        result = super().time_micro_batch(row, busy)
        key = (row.strategy, int(row.micro_batch_index))
        if key in self.spiked and key not in self.seen:
            self.seen.add(key)
            result["time_s"] *= 1.3
            result["times_s"] = [result["time_s"]]
        return result


def run_with_one_spiked_unit(plans, runner_class, budget_s):
    """run_sequential on a known-cost runner whose 4th first-round unit in a shared stratum is
    `spiked`: the result, the spiked unit's key and the cost."""
    design = build_design(plans, 3, seed=0)
    first = new_units(
        design, {k: min(v, 2) for k, v in design.sizes.items()}, {}, np.random.default_rng(11)
    )
    # a unit whose stratum holds other micro-batches too (the estimate needs one timed unit
    # per stratum; the 4th first-round unit of a stratum of its own would leave it none)
    shared = first[first["stratum_size"] > 2].iloc[3]
    spiked = (shared["strategy"], int(shared["micro_batch_index"]))
    clock, cost = [0.0], SimulatedCost.scaled_to(plans)
    runner = runner_class(cost, clock, [spiked])
    settings = ReplaySettings(3, 2, 100, ACCUM, seed=0, warmup=0, busy_samples_per_stratum=0)
    result = run_sequential(
        runner, design, settings, list(design.strategies), 0.01, 4.0, budget_s, 12,
        clock=lambda: clock[0],
    )  # fmt: skip
    return result, spiked, cost


def test_a_preempted_unit_is_timed_again_and_priced_at_the_median(plans):
    result, spiked, cost = run_with_one_spiked_unit(plans, SpikyRunner, 1e6)
    steps = result.steps.set_index(["strategy", "micro_batch_index"])
    unit = steps.loc[spiked]
    exact = float(cost.micro_batch_s(pd.DataFrame([unit.to_dict() | {"strategy": spiked[0]}]))[0])
    assert unit["timings"] == 3 and len(unit["times_s"]) == 3
    assert unit["time_s"] == pytest.approx(exact)  # the median drops the preempted timing
    assert result.record["retimed_micro_batches"] >= 1
    # every other unit keeps its exact (noise-free) time, however often it was timed
    frame = result.steps
    assert np.allclose(frame["time_s"], cost.micro_batch_s(frame))


def test_outlier_units_flags_only_a_far_residual_with_few_timings():
    from probes.replay.outliers import outlier_units

    relative = {"a": np.array([0.01, -0.02, 0.015, 0.0, -0.01, 0.02, -0.015, 0.005, 0.3])}
    once = {"a": np.ones(9)}
    assert outlier_units(relative, once, cv=0.01)["a"].tolist() == [False] * 8 + [True]
    assert not outlier_units(relative, {"a": np.r_[np.ones(8), 3]}, cv=0.01)["a"].any()
    assert not outlier_units(relative, once, cv=0.2)["a"].any()  # within 3 × CV


def test_a_strategy_noisy_throughout_is_judged_by_its_own_spread():
    """Units of a strategy 12% noisy among strategies at 1%: against the pooled spread a third
    of them would be timed again; against its own, only the one far outlier."""
    from probes.replay.outliers import outlier_units

    rng = np.random.default_rng(0)
    quiet = 0.01 * rng.standard_normal(80)
    noisy = 0.12 * rng.standard_normal(30)
    noisy[0] = 1.5
    flags = outlier_units({"quiet": quiet, "noisy": noisy},
                          {"quiet": np.ones(80), "noisy": np.ones(30)}, cv=0.01)  # fmt: skip
    assert flags["noisy"].tolist() == [True] + [False] * 29


class FailsOnRetimeRunner(SpikyRunner):
    """The spiked micro-batch runs out of memory when it is timed again."""

    def time_micro_batch(self, row, busy=False):
        key = (row.strategy, int(row.micro_batch_index))
        if key in self.spiked and key in self.seen:
            return {"status": "OOM", "time_s": np.nan, "times_s": [], "gpu_busy_share": np.nan}
        return super().time_micro_batch(row, busy)


def test_a_unit_that_fails_when_timed_again_ends_the_retiming_with_its_status(plans):
    result, spiked, _ = run_with_one_spiked_unit(plans, FailsOnRetimeRunner, 60.0)
    unit = result.steps.set_index(["strategy", "micro_batch_index"]).loc[spiked]
    assert unit["status"] == "OOM" and np.isnan(unit["time_s"])


def test_the_power_record_prices_what_would_decide_each_undecided_change():
    """An undecided change at 10% ± 20 pp on 4 units excludes 0 at ±10 pp: 4·(20/10)² = 16 units,
    12 more, at its own and the baseline's unit times; a tie at 0 ± 6 pp decides inside ±5 pp
    (2 more); one at 4.3% ± 4.5 pp needs one more to exclude 0; a decided change and the
    baseline need none."""
    from types import SimpleNamespace

    from probes.replay.greg import GregEstimate
    from probes.replay.outputs import decision_power

    def est(low, high):
        return GregEstimate(1.0, 0.9, 1.1, 0.5 * (low + high), low, high, 5.0, 1, 0, 0, {})

    steps = pd.DataFrame(
        {
            "kind": "micro_batch",
            "status": "OK",
            "strategy": [pl.BASELINE] * 4
            + ["open"] * 4
            + ["decided"] * 4
            + ["tie"] * 4
            + ["edge"] * 4,
            "time_s": [1.0] * 4 + [2.0] * 4 + [1.0] * 12,
        }
    )
    estimates = {
        pl.BASELINE: est(0, 0),
        "open": est(-0.1, 0.3),
        "decided": est(0.2, 0.3),
        "tie": est(-0.06, 0.06),
        "edge": est(-0.002, 0.088),
    }
    settings = ReplaySettings(3, 2, 100, ACCUM, decide_within=0.05, max_width=0.2)
    power = decision_power(
        SimpleNamespace(steps=steps, estimates=estimates), settings, "replay.cpu.budget_s"
    )
    assert power["undecided"] == ["edge", "open", "tie"]
    assert {n: v["units"] for n, v in power["per_change"].items()} == {
        "open": 12, "tie": 2, "edge": 1
    }  # fmt: skip
    assert power["seconds_to_decide"] == pytest.approx(12 * 3.0 + 2 * 2.0 + 1 * 2.0)
    assert power["key"] == "replay.cpu.budget_s"


def test_the_budget_goes_to_the_changes_it_can_decide(plans):
    """Before timing: at a measured CV each change needs units_to_resolve units; the budget is
    spent by exact token saving, a batching change whose exact saving is below what timing
    resolves is never timed, and the rest say what deciding them would take."""
    from probes.replay.strata import affordable_changes, units_to_resolve

    assert units_to_resolve(0.03, 0.2, 4) == 4  # a quiet CPU: the first round decides
    assert units_to_resolve(0.2, 0.2, 4) == 63  # a loaded one: (2 * 2.8 * sqrt2 * 0.2 / 0.2)^2
    tokens = float(plans["computed_tokens"].mean())
    everything = affordable_changes(plans, (0.01, tokens), 0.03, 0.2, 1e6, 4, pl.BASELINE)
    saving = {
        n: 1
        - g["computed_tokens"].sum()
        / plans[plans["strategy"] == pl.BASELINE]["computed_tokens"].sum()
        for n, g in plans.groupby("strategy")
    }
    small = {n for n, v in saving.items() if 0 < abs(v) < 0.1 and n != pl.BASELINE}
    assert set(everything[1]) == {
        n
        for n in small
        if (plans["strategy"] == n).sum() == (plans["strategy"] == pl.BASELINE).sum()
    }
    assert all("below what timing resolves" in why for why in everything[1].values())
    kept, dropped = affordable_changes(plans, (1.0, tokens), 0.2, 0.2, 25.0, 4, pl.BASELINE)
    assert kept[0] == pl.BASELINE and 1 <= len(kept) < len(everything[0])
    timed_savings = [abs(saving[n]) for n in kept[1:]]
    assert all(abs(saving[n]) <= min(timed_savings) for n in dropped if n not in small)
    assert any("would take about" in why and "63 units" in why for why in dropped.values())


def test_the_next_round_weights_each_undecided_change_by_its_width():
    from types import SimpleNamespace

    from probes.replay.strata import widest_first

    def interval(low, high):
        return SimpleNamespace(saving_low=low, saving_high=high)

    estimates = {"wide": interval(-1.0, 0.2), "narrow": interval(-0.1, 0.2), "random": None}
    weights = widest_first({"wide": 1.0, "narrow": 1.0, "random": 5.0}, estimates,
                           ["wide", "narrow"])  # fmt: skip
    assert weights["wide"] == 1.0
    assert weights["narrow"] == pytest.approx((0.3 / 1.2) ** 2)
    assert weights["random"] == pytest.approx(5.0 * (1.0 + (0.3 / 1.2) ** 2) / 2)
    assert widest_first({"a": 2.0}, {}, ["a"]) == {"a": 2.0}


def test_the_baseline_is_weighted_as_far_as_the_changes_it_narrows_are_wide():
    """The baseline's weight (one share per unpaired change) takes the mean of their width
    factors: unscaled, it took 10-11 of the 12 units of the round after the first in the AVX2
    runs while every change kept its 4. A paired change's factor does not count (its ratio is
    on its own pairs)."""
    from types import SimpleNamespace

    from probes.replay.strata import widest_first

    def interval(low, high):
        return SimpleNamespace(saving_low=low, saving_high=high)

    estimates = {"wide": interval(-0.2, 0.2), "narrow": interval(-0.1, 0.1),
                 "pair": interval(-0.1, 0.1), pl.BASELINE: interval(0.0, 0.0)}  # fmt: skip
    weights = {"wide": 1.0, "narrow": 1.0, "pair": 1.0, pl.BASELINE: 2.0}
    scaled = widest_first(weights, estimates, ["wide", "narrow", "pair"], paired={"pair"})
    assert scaled["wide"] == 1.0 and scaled["narrow"] == pytest.approx(0.25)
    assert scaled["pair"] == pytest.approx(0.25)
    assert scaled[pl.BASELINE] == pytest.approx(2.0 * (1.0 + 0.25) / 2)
    # only paired changes open: the baseline keeps what strategy_weights gave it (none)
    alone = widest_first({"pair": 1.0, pl.BASELINE: 0.0}, estimates, ["pair"], paired={"pair"})
    assert alone[pl.BASELINE] == 0.0


def test_the_baseline_is_weighted_for_the_unpaired_changes_only():
    """A paired change's saving is its ratio on the same micro-batches: the baseline's own
    sample does not narrow it, so once only paired changes are open the baseline gets no weight
    of its own (its units come as their twins)."""
    from probes.replay.strata import strategy_weights

    totals = {pl.BASELINE: 1.0, "packing": 1.0, "checkpointing": 1.0}
    both = strategy_weights(totals, ["packing", "checkpointing"], paired={"checkpointing"})
    assert both[pl.BASELINE] == 1.0 and both["checkpointing"] == 1.0
    alone = strategy_weights(totals, ["checkpointing"], others_weight=0.0, paired={"checkpointing"})
    assert alone[pl.BASELINE] == 0.0 and alone["packing"] == 0.0
    assert strategy_weights(totals, ["packing", "checkpointing"])[pl.BASELINE] == 2.0
    assert strategy_weights({pl.BASELINE: 1.0}, [])[pl.BASELINE] == 1.0  # nothing else to decide


class SlowerChangeRunner(KnownCostRunner):
    """Checkpointing's micro-batches cost 1.3x the baseline's."""

    def time_micro_batch(self, row, busy=False):
        result = super().time_micro_batch(row, busy)
        if row.strategy == "gradient_checkpointing_on":
            result["time_s"] *= 1.3
            result["times_s"] = [result["time_s"]]
        return result


def paired_design(plans):
    """The plans with a checkpointing change on the baseline's own micro-batches, 2 strata."""
    change = plans[plans["strategy"] == pl.BASELINE].assign(strategy="gradient_checkpointing_on")
    return build_design(pd.concat([plans, change], ignore_index=True), 2, seed=0)


def timed_pairs(plans, design, takes, cv):
    """`takes` timed at a known cost (checkpointing 1.3x) with unit noise `cv`: (steps,
    estimates)."""
    from probes.replay.greg import greg_estimate_all
    from probes.replay.sequential import strategy_designs
    from probes.replay.timing import run_sample

    runner = SlowerChangeRunner(SimulatedCost.scaled_to(plans), cv, [0.0])
    units = new_units(design, takes, {}, np.random.default_rng(0))
    settings = ReplaySettings(2, 3, 100, ACCUM, seed=0, warmup=0, busy_samples_per_stratum=0)
    steps, _ = run_sample(runner, units, settings)
    return steps, greg_estimate_all(strategy_designs(design, steps), np.array([0.1]), cv, 4.0)[0]


def test_an_open_paired_change_gets_the_next_round_with_its_twins(plans):
    """The default run's case: checkpointing (paired) the widest open change; the next round
    goes to its pairs, each unit priced with its twin's time and allocated by its pairs' own
    spread, not to baseline units it cannot use."""
    from probes.replay.sequential import next_takes, unit_costs

    design = paired_design(plans)
    takes = {k: min(v, 3) for k, v in design.sizes.items()}
    steps, estimates = timed_pairs(plans, design, takes, 0.15)
    pair = estimates["gradient_checkpointing_on"]
    assert pair.strata_residual_sd != estimates[pl.BASELINE].strata_residual_sd
    costs = unit_costs(design, steps)
    for h in (0, 1):
        twin = costs[(pl.BASELINE, h)]
        assert costs[("gradient_checkpointing_on", h)] > twin  # its own 1.3x and the twin's
    grown = next_takes(design, takes, estimates, steps, 0.15, ["gradient_checkpointing_on"], 12)
    added = {n: sum(v - takes[k] for k, v in grown.items() if k[0] == n) for n in design.plans}
    assert added["gradient_checkpointing_on"] == 12
    assert added[pl.BASELINE] <= 12  # only the twins the new pairs need
    assert sum(added.values()) - added[pl.BASELINE] == 12


def test_a_paired_change_with_one_pair_is_allocated_by_the_baselines_spread(plans):
    """Under two pairs a paired change has no spread of its own: the design reads the
    baseline's, not the instrument's floor, so the change is not starved of units."""
    design = paired_design(plans)
    takes = {k: (1 if k == ("gradient_checkpointing_on", 0) else 0)
             if k[0] == "gradient_checkpointing_on" else min(v, 3)
             for k, v in design.sizes.items()}  # fmt: skip
    _, estimates = timed_pairs(plans, design, takes, 0.1)
    pair = estimates["gradient_checkpointing_on"]
    assert pair.strata_residual_sd == estimates[pl.BASELINE].strata_residual_sd != {}
