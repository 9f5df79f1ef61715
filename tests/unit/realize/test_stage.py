"""The realize stage on a synthetic harness of known cost (probes.replay.control's SyntheticCost):
on a virtual clock the harness advances by the known cost, it recovers the exact epoch time
within its interval and agrees with an exact promise; with the replay's sleeping harness, an
optimizer step that sleeps longer than promised is caught as a disagreement naming it."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from conftest import workflow_config
from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.contracts import GLOBAL_SORT, PACKING, RANDOM, TRAINING_STATUSES, table_columns
from probes.io import read_json, write_parquet
from probes.realize import sample as sm
from probes.realize import stage as rz
from probes.realize.control import VirtualClock, run_control, virtual_runner
from probes.realize.verdict import AGREES, DISAGREES
from probes.replay.timing import MICRO_BATCH, OPTIMIZER_STEP
from probes.step.synthetic import SyntheticCost, exact_epoch_s, synthetic_runner

MICRO, ACCUM, MAX_LEN, SAMPLE, WIDTH = 2, 2, 512, 12, 0.05


@pytest.fixture(scope="module")
def plans() -> pd.DataFrame:
    frame = bucket_controls.synthetic_lengths_frame(128, seed=2, max_seq_len=MAX_LEN)
    used = frame[frame["status"].isin(TRAINING_STATUSES)]
    lengths = used["n_tokens"].to_numpy(np.int64)
    examples = pl.PlanExamples(used["example_id"].to_numpy(object), lengths, lengths // 2)
    return pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, bucket_size_batches=4, seed=0)


@pytest.fixture(scope="module")
def cost(plans) -> SyntheticCost:
    return cost_of(plans)


def cost_of(plans: pd.DataFrame) -> SyntheticCost:
    return SyntheticCost.scaled_to(plans, 0.005, 0.005, 0.005, 0.004)


def exact_promise(plans: pd.DataFrame, cost: SyntheticCost) -> pd.DataFrame:
    """The replay table a perfect replay would write: the exact epoch times and savings."""
    exact = exact_epoch_s(plans, cost, ACCUM)
    steps = plans.groupby("strategy")["optimizer_step_index"].nunique()
    rows = []
    for name, seconds in exact.items():
        saving = 1 - seconds / exact[RANDOM]
        rows.append(
            {
                **dict.fromkeys(table_columns("replay_estimates")),
                "strategy": name,
                "valid": True,
                "estimated_time_s": seconds,
                "ci_low_s": 0.97 * seconds,
                "ci_high_s": 1.03 * seconds,
                "saving_vs_random": saving,
                "saving_ci_low": saving - WIDTH,
                "saving_ci_high": saving + WIDTH,
                "optimizer_steps": int(steps[name]),
                "optimizer_step_s": cost.optimizer_s,
                "cpu_only": True,
            }
        )
    return pd.DataFrame(rows)


def replay_units(
    plans: pd.DataFrame, cost: SyntheticCost, per_strategy: int = 12, noise: float = 0.02
) -> pd.DataFrame:
    """The timed units a replay of `cost` would write: some micro-batches of every plan at their
    cost with relative timing noise `noise` (so the promise refitted on them is not exact), and
    optimizer steps."""
    picked = plans.groupby("strategy", group_keys=False).apply(
        lambda plan: plan.sample(min(per_strategy, len(plan)), random_state=0)
    )
    micro = picked.assign(
        kind=MICRO_BATCH,
        status="OK",
        time_s=[
            cost.micro_batch_s(*pl.batch_shape(r)) * (1 + noise * z)
            for r, z in zip(
                picked.itertuples(),
                np.random.default_rng(1).standard_normal(len(picked)),
                strict=True,
            )
        ],
    )
    optimizer = pd.DataFrame(
        {"kind": [OPTIMIZER_STEP] * 3, "status": "OK", "time_s": cost.optimizer_s}
    )
    return pd.concat([micro, optimizer], ignore_index=True)


def run_stage(tmp_path, plans, promise, runner, clock=None, units=None, **realize):
    paths = {
        "estimates": tmp_path / "replay.parquet",
        "plans": tmp_path / "plans.parquet",
        "units": tmp_path / "replay_steps.parquet",
    }
    write_parquet(promise, paths["estimates"], {})
    write_parquet(plans, paths["plans"], {})
    write_parquet(
        replay_units(plans, cost_of(plans)) if units is None else units, paths["units"], {}
    )
    inputs = {**paths, "lengths": "unused", "recommendation": "unused"}
    outputs = {k: str(tmp_path / f"realize_{k}") for k in rz.OUTPUT_KEYS}
    cfg = workflow_config(
        training={"micro_batch_size": MICRO, "grad_accum": ACCUM, "max_seq_len": MAX_LEN},
        profile={"device": "cpu", "allow_cpu": True},
        replay={"cpu": {"max_seq_len": MAX_LEN}},  # the plans as they are (no CPU cap)
        realize={
            "cpu_sample_steps": SAMPLE,
            "cpu_budget_s": 0,
            "warmup": 1,
            "cpu_max_changes": 2,
            **realize,
        },
    )

    def load(model_path, cfg, device, max_length):
        clocks = () if clock is None else (clock,)
        return (runner, 64, 0, {"spec": "synthetic"}, "float32", "test", *clocks)

    summary = rz.run_realize(inputs, outputs, cfg, tmp_path, load=load)
    return summary, pd.read_parquet(outputs["realized"]), outputs


def test_recovers_the_exact_epoch_time_within_its_interval_and_agrees(tmp_path, plans, cost):
    clock = VirtualClock()
    promise = exact_promise(plans, cost)
    summary, table, outputs = run_stage(
        tmp_path, plans, promise, virtual_runner(cost, clock), clock
    )
    exact = exact_epoch_s(plans, cost, ACCUM)
    assert list(table["strategy"]) == [RANDOM, GLOBAL_SORT, PACKING]  # the top two, by saving
    steps = pd.read_parquet(outputs["steps"])  # each step beside its promise, within 5%
    assert (steps["micro_batch_s"] / steps["promised_micro_batch_s"] - 1).abs().max() < 0.05
    for row in table.itertuples():
        assert row.sampled_steps == min(SAMPLE, row.optimizer_steps)
        # on this noiseless clock the interval (0.1-0.4% wide) is narrower than the promise's
        # structured misfit; coverage under timing noise: test_sample
        assert row.realized_time_s == pytest.approx(exact[row.strategy], rel=0.005)
        assert row.realized_ci_high_s - row.realized_ci_low_s < 0.01 * row.realized_time_s
    changes = table[table["role"] == "change"]
    assert set(changes["verdict"]) == {AGREES}
    assert set(summary["verdicts"].values()) == {AGREES}


@pytest.mark.skipif(pl.BATCH_REBALANCE not in pl.STRATEGIES, reason="no batch_rebalance plan")
def test_batch_rebalance_ranked_by_the_replay_is_realized_over_its_own_micro_batches(
    tmp_path, plans, cost
):
    """transformers' batch_rebalance, ranked first, is checked by real steps of its own plan:
    micro-batches of varying rows (more than micro_batch_size in some), the exact epoch time
    recovered, the verdict agrees."""
    clock = VirtualClock()
    promise = exact_promise(plans, cost)
    promise = promise[promise["strategy"].isin([RANDOM, pl.BATCH_REBALANCE])]
    assert promise.set_index("strategy").loc[pl.BATCH_REBALANCE, "saving_vs_random"] > 0
    summary, table, outputs = run_stage(
        tmp_path, plans, promise, virtual_runner(cost, clock), clock
    )
    assert list(table["strategy"]) == [RANDOM, pl.BATCH_REBALANCE]
    exact = exact_epoch_s(plans, cost, ACCUM)[pl.BATCH_REBALANCE]
    realized = table.set_index("strategy").loc[pl.BATCH_REBALANCE]
    assert realized["realized_time_s"] == pytest.approx(exact, rel=0.005)
    assert summary["verdicts"] == {pl.BATCH_REBALANCE: AGREES}
    own = plans[plans["strategy"] == pl.BATCH_REBALANCE]
    assert own["rows"].max() > MICRO and own["rows"].min() >= 1


def test_under_timing_noise_the_exact_epoch_time_lies_within_its_interval(tmp_path, plans, cost):
    # 2% noise per micro-batch, as on this CPU; five seeds of the step sample, three strategies
    promise = exact_promise(plans, cost)
    exact = exact_epoch_s(plans, cost, ACCUM)
    covered = []
    for seed in range(5):
        clock = VirtualClock()
        runner = virtual_runner(cost, clock, noise=0.02, seed=seed)
        directory = tmp_path / str(seed)
        directory.mkdir()
        _, table, _ = run_stage(directory, plans, promise, runner, clock, seed=seed)
        for row in table.itertuples():
            covered.append(row.realized_ci_low_s <= exact[row.strategy] <= row.realized_ci_high_s)
    assert sum(covered) >= 13, covered  # 95% intervals: 14.25 of 15 expected


def half_the_packed_steps(plans: pd.DataFrame) -> pd.DataFrame:
    """Packing at its pasted shape keeps tokens per update (about random's optimizer steps);
    here its micro-batches are stepped two at a time, so an optimizer slower than promised
    moves its saving against random's by a known direction."""
    plans = plans.copy()
    packed = plans["strategy"] == PACKING
    plans.loc[packed, "optimizer_step_index"] = plans.loc[packed, "micro_batch_index"] // 2
    return plans


def test_an_optimizer_that_sleeps_extra_is_a_disagreement_naming_it(tmp_path, plans, cost):
    clock = VirtualClock()
    slow = dataclasses.replace(cost, optimizer_s=cost.optimizer_s + 0.02)
    plans = half_the_packed_steps(plans)
    promise = exact_promise(plans, cost)  # what a replay of the promised harness measured
    _, table, _ = run_stage(tmp_path, plans, promise, virtual_runner(slow, clock), clock)
    changes = table[table["role"] == "change"]
    assert set(changes["verdict"]) == {DISAGREES}
    assert all(d.startswith("optimizer time") for d in changes["differed"])
    assert (changes["diff_optimizer_pp"].abs() > 5).all()
    assert (changes["diff_micro_batch_pp"].abs() < 1).all()


def test_a_really_sleeping_optimizer_is_caught_on_the_wall_clock(tmp_path, plans, cost):
    # the replay control's harness sleeps its known cost; packing has half the optimizer
    # steps, so an optimizer 100 ms slower than promised moves its saving by tens of pp, far
    # beyond what a loaded machine adds to the micro-batches' few milliseconds
    slow = dataclasses.replace(cost, optimizer_s=cost.optimizer_s + 0.1)
    plans = half_the_packed_steps(plans)
    promise = exact_promise(plans, cost)
    _, table, _ = run_stage(tmp_path, plans, promise, synthetic_runner(slow), cpu_sample_steps=3)
    packing = table.set_index("strategy").loc[PACKING]
    assert packing["verdict"] == DISAGREES
    assert "optimizer time +" in packing["differed"] and packing["diff_optimizer_pp"] > 10


def test_control_passes_on_the_plans_and_fails_on_a_broken_estimator(plans, monkeypatch):
    control = run_control(plans, [RANDOM, PACKING, GLOBAL_SORT], 32, 0, ACCUM)
    assert control["passed"], control["observed"]
    # an estimator 10% high is caught
    real = sm.epoch_estimate

    def high(*args):
        estimate = real(*args)
        return dataclasses.replace(estimate, total_s=1.1 * estimate.total_s)

    monkeypatch.setattr(sm, "epoch_estimate", high)
    broken = run_control(plans, [RANDOM, PACKING, GLOBAL_SORT], 32, 0, ACCUM)
    assert not broken["passed"]


def test_disabled_writes_a_not_run_note(tmp_path, plans, cost):
    clock = VirtualClock()
    summary, table, outputs = run_stage(
        tmp_path, plans, exact_promise(plans, cost), virtual_runner(cost, clock), enabled=False
    )
    assert summary["status"] == "not_run" and table.empty
    assert read_json(outputs["summary"])["reason"] == "realize.enabled is false"


def test_a_change_that_runs_out_of_memory_disagrees_and_says_so(tmp_path, plans, cost):
    clock = VirtualClock()
    runner = virtual_runner(cost, clock)
    compute_loss = runner.harness.compute_loss

    def out_of_memory_when_packed(model, batch):
        if batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] > MAX_LEN:
            raise RuntimeError("CUDA out of memory (synthetic)")
        return compute_loss(model, batch)

    runner.harness.compute_loss = out_of_memory_when_packed
    _, table, _ = run_stage(tmp_path, plans, exact_promise(plans, cost), runner, clock, warmup=0)
    packing = table.set_index("strategy").loc[PACKING]
    assert packing["verdict"] == DISAGREES and "out of memory" in packing["differed"]


def test_on_cpu_checks_only_cpu_max_changes(tmp_path, plans, cost):
    clock = VirtualClock()
    promise = exact_promise(plans, cost)
    summary, table, _ = run_stage(
        tmp_path, plans, promise, virtual_runner(cost, clock), clock, cpu_max_changes=1
    )
    assert list(table["strategy"]) == [RANDOM, GLOBAL_SORT] and summary["changes"] == [GLOBAL_SORT]


def test_rounds_are_added_while_the_budget_holds_one_more(tmp_path, plans, cost):
    promise = exact_promise(plans, cost)

    def timed(directory, **realize):
        clock = VirtualClock()
        directory.mkdir()
        summary, table, outputs = run_stage(
            directory, plans, promise, virtual_runner(cost, clock), clock, **realize
        )
        return summary, table, pd.read_parquet(outputs["steps"])

    _, _, first = timed(tmp_path / "first")
    per_round = first["time_s"].sum() / SAMPLE  # virtual seconds of one step of each strategy
    budget = first["time_s"].sum() + 2.5 * per_round  # room for two more rounds, not three
    summary, table, steps = timed(tmp_path / "budget", cpu_budget_s=budget)
    assert set(table["sampled_steps"]) == {SAMPLE + 2}
    assert summary["sample_steps"] == SAMPLE + 2 and summary["first_sample_steps"] == SAMPLE
    # the first SAMPLE of each strategy are the same steps: rounds only add
    key = ["strategy", "optimizer_step_index"]
    assert set(map(tuple, first[key].values)) <= set(map(tuple, steps[key].values))


def test_a_missing_replay_table_is_named_with_the_rule_that_writes_it(tmp_path):
    with pytest.raises(rz.RealizeError, match="replay.parquet: no such file; it is written by"):
        rz.read_estimates(tmp_path / "replay.parquet")


def test_the_changes_checked_are_the_best_measured_and_never_the_dataloader_workers():
    estimates = pd.DataFrame(
        {
            "strategy": ["random", "dataloader_workers_2", "packing", "length_grouped", "slow"],
            "valid": [True, True, True, True, True],
            "saving_vs_random": [0.0, 0.5, 0.3, 0.2, -0.1],
            "saving_ci_low": [0.0, 0.4, 0.1, -0.1, -0.2],
        }
    )
    assert rz.select_changes(estimates, 3) == ["packing", "length_grouped"]
