"""Realize's positive control on plans with a micro-batch-size change (twice the rows at equal
tokens per update, so half the micro-batches per step) and a replay promise fitted on timings of
another cost than the control's: the control's promise is the replay's working model refitted on
the replay's own timed shapes at the control's known cost, so it recovers the exact epoch time
whatever the real step cost; a broken estimator still fails it."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.contracts import RANDOM
from probes.realize import control as ct
from probes.realize import estimate as es
from probes.replay.greg import auxiliaries
from probes.replay.timing import MICRO_BATCH, OPTIMIZER_STEP

MICRO_4 = "micro_batch_size_4"
MAX_LEN, EXAMPLES = 64, 384


@pytest.fixture(scope="module")
def plans() -> pd.DataFrame:
    """The baseline at 2 rows × 4 micro-batches and the change at 4 rows × 2 (the same tokens
    per update), heavy-tailed lengths at a CPU rehearsal's cap, half the examples unlabelled."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.pareto(1.2, EXAMPLES) * 8 + 2, MAX_LEN).astype(np.int64)
    loss = np.where(rng.random(EXAMPLES) < 0.5, 0, lengths // 2)
    ids = np.array([f"{i:08x}" for i in range(EXAMPLES)], dtype=object)
    examples = pl.PlanExamples(ids, lengths, loss)

    def baseline(micro: int, accum: int) -> pd.DataFrame:
        built = pl.build_plans(examples, micro, accum, MAX_LEN, 1, seed=0)
        return built[built["strategy"] == pl.BASELINE]

    return pd.concat([baseline(2, 4), baseline(4, 2).assign(strategy=MICRO_4)], ignore_index=True)


def replay_units(plans: pd.DataFrame) -> pd.DataFrame:
    """What a replay writes when its step's cost follows the loss tokens (an LM head run on the
    labelled positions only), not the shape the control's synthetic cost follows."""
    picked = plans.groupby("strategy", group_keys=False).apply(
        lambda plan: plan.sample(16, random_state=1)
    )
    micro = picked.assign(
        kind=MICRO_BATCH, status="OK", time_s=1e-4 + 1e-4 * auxiliaries(picked)[:, 3]
    )
    optimizer = pd.DataFrame({"kind": [OPTIMIZER_STEP] * 2, "status": "OK", "time_s": 0.01})
    return pd.concat([micro, optimizer], ignore_index=True)


@pytest.mark.parametrize("steps", [8, 16, 32])
def test_recovers_the_epoch_of_a_micro_batch_size_change_on_any_replay_cost(plans, steps):
    units = replay_units(plans)
    for seed in range(3):
        control = ct.run_control(plans, [RANDOM, MICRO_4], steps, seed, 4, units=units)
        assert control["passed"], control["observed"]
        for name in (RANDOM, MICRO_4):
            assert control["observed"]["strategies"][name]["sampled_steps"] == steps


def test_control_promise_is_the_known_cost_of_every_step(plans):
    cost = ct.SyntheticCost.scaled_to(plans)
    promises = ct.control_promises(plans, replay_units(plans), cost)
    exact = ct.exact_epoch_s(plans, cost, 4)
    for name in (RANDOM, MICRO_4):
        steps = promises.xs(name, level="strategy")
        optimizer = plans[plans["strategy"] == name]["optimizer_step_index"].nunique()
        assert steps.sum() + optimizer * cost.optimizer_s == pytest.approx(exact[name])


def test_without_replay_units_the_promise_is_the_step_size(plans):
    assert ct.control_promises(plans, None, ct.SyntheticCost.scaled_to(plans)) is None
    optimizer_only = replay_units(plans).iloc[-2:]
    assert ct.control_promises(plans, optimizer_only, ct.SyntheticCost.scaled_to(plans)) is None


def test_a_broken_estimator_fails_the_control(plans, monkeypatch):
    real = es.epoch_estimates

    def high(*args):
        return {
            name: (dataclasses.replace(estimate, total_s=1.2 * estimate.total_s), phases)
            for name, (estimate, phases) in real(*args).items()
        }

    monkeypatch.setattr(ct, "epoch_estimates", high)
    control = ct.run_control(plans, [RANDOM, MICRO_4], 16, 0, 4, units=replay_units(plans))
    assert not control["passed"]


def test_a_non_positive_promise_falls_back_to_step_sizes(plans):
    promises = pd.Series(
        1.0, index=pd.MultiIndex.from_frame(plans[["strategy", "optimizer_step_index"]])
    )
    promises = promises[~promises.index.duplicated()]
    promises.loc[(MICRO_4, 0)] = -0.5
    aux = es.step_auxiliaries(plans, promises)
    own = plans[plans["strategy"] == MICRO_4]
    assert aux[MICRO_4].equals(es.step_sizes(own))
    assert (aux[RANDOM] == 1.0).all()
