"""Realize's positive control (``run_control``): the stage's own step sampling, step timing and
estimator on a synthetic harness of known cost (probes.step.synthetic.SyntheticCost) whose
compute_loss and optimizer step advance a virtual clock by that cost, so every step's time, and
the epoch's, is known exactly. Each checked strategy's estimated epoch time must be within
`tolerance` of the exact one, and so must its optimizer phase (the phase clock's attribution).
Costs no wall time beyond building the sampled batches: it runs before the weights load.

The estimator's auxiliary is what the replay would have promised for this cost
(``control_promises``): the stage's own promise (probes.realize.promise.step_promises) refitted
on the micro-batches the replay timed, each at its known cost. Paired with the replay's real
promise, which follows the real step and not this cost, the ratio estimator's error measured how
far the two costs differ in shape from step to step, not the stage: on a plain script's plans,
micro_batch_size_4 (twice the rows, half the micro-batches per step at equal tokens per update)
missed its exact epoch by 5 to 15% with 16 to 64 sampled steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching.plans import batch_shape
from probes.realize.estimate import epoch_estimates, step_auxiliaries
from probes.realize.promise import step_promises
from probes.realize.steps import StepTimer
from probes.realize.timing import measure
from probes.replay.timing import MICRO_BATCH
from probes.step.synthetic import SyntheticCost, exact_epoch_s, known_cost_runner
from probes.step.timing import OK

CONTROL_NAME = "realize_recovers_known_step_cost"


class VirtualClock:
    """A clock that moves only when the synthetic harness spends its known cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _NoLoss:
    def backward(self) -> None:
        pass


class _VirtualOptimizer(torch.optim.SGD):
    def __init__(self, params: Any, clock: VirtualClock, seconds: float) -> None:
        super().__init__(params, lr=0.0)
        self.clock, self.seconds = clock, seconds

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        self.clock.now += self.seconds
        return super().step(closure)


def virtual_runner(
    cost: SyntheticCost, clock: VirtualClock, noise: float = 0.0, seed: int = 0
) -> Any:
    """A StepRunner whose compute_loss advances `clock` by the micro-batch's known cost (times
    1 + `noise`·z, z standard normal: a timing's relative noise) and whose optimizer step by
    the optimizer's."""
    rng = np.random.default_rng(seed)

    def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> _NoLoss:
        rows, length = batch["input_ids"].shape
        factor = 1.0 + noise * float(rng.standard_normal()) if noise else 1.0
        clock.now += cost.micro_batch_s(int(rows), int(length)) * factor
        return _NoLoss()

    model = torch.nn.Linear(1, 1)
    optimizer = _VirtualOptimizer(model.parameters(), clock, cost.optimizer_s)
    return known_cost_runner(
        compute_loss, optimizer, model, "probes.realize.control:virtual", __name__
    )


def control_promises(
    plans: pd.DataFrame, units: pd.DataFrame | None, cost: SyntheticCost
) -> pd.Series | None:
    """Every step's promise at `cost`: the replay's timed micro-batches (`units`, its steps
    table) each at its known cost, refitted and summed per step by the stage's own
    step_promises; None (the stage's step sizes) where the replay timed no micro-batch."""
    if units is None:
        return None
    micro = units[(units["kind"] == MICRO_BATCH) & (units["status"] == OK)]
    if micro.empty:
        return None
    known = [cost.micro_batch_s(*batch_shape(row)) for row in micro.itertuples()]
    return step_promises(plans, micro.assign(time_s=known))


def run_control(
    plans: pd.DataFrame,
    strategies: Sequence[str],
    sample_size: int,
    seed: int,
    grad_accum: int,
    tolerance: float = 0.05,
    units: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """The stage's sample, timing and estimator on the virtual-clock harness (see module), its
    auxiliary the promise the replay's timed `units` give at the control's cost."""
    started = time.perf_counter()
    cost = SyntheticCost.scaled_to(plans)
    promises = control_promises(plans, units, cost)
    clock = VirtualClock()
    timer = StepTimer(virtual_runner(cost, clock), 64, 0, seed, clock)
    steps = measure(timer, plans, strategies, sample_size, 0, seed)
    exact = exact_epoch_s(plans[plans["strategy"].isin(strategies)], cost, grad_accum)
    aux = step_auxiliaries(plans[plans["strategy"].isin(strategies)], promises)
    realized = epoch_estimates(steps, aux)
    per_strategy, passed = {}, True
    for name in strategies:
        estimate, phases = realized[name]
        optimizer_exact = len(aux[name]) * cost.optimizer_s
        errors = {
            "epoch": abs(estimate.total_s / float(exact[name]) - 1.0),
            "optimizer": abs(phases.optimizer / optimizer_exact - 1.0),
        }
        ok = all(np.isfinite(e) and e <= tolerance for e in errors.values())
        passed &= ok
        per_strategy[name] = {
            "exact_time_s": float(exact[name]),
            "estimated_time_s": estimate.total_s,
            "ci_low_s": estimate.low_s,
            "ci_high_s": estimate.high_s,
            "sampled_steps": estimate.sampled,
            "optimizer_steps": estimate.steps,
            "rel_error": errors,
            "passed": bool(ok),
        }
    return {
        "name": CONTROL_NAME,
        "description": (
            "a synthetic harness advances a virtual clock by c + b*rows*T + a*rows*T^2 per "
            "micro-batch and a fixed optimizer step; the stage's sample of whole steps, its phase "
            "clock and its estimator must recover each strategy's exact epoch time (over the "
            "whole plan) and its optimizer phase"
        ),
        "expected": {
            "cost": {"a": cost.a, "b": cost.b, "c": cost.c, "optimizer_s": cost.optimizer_s},
            "rel_error_max": tolerance,
            "sample_steps": sample_size,
        },
        "observed": {
            "strategies": per_strategy,
            "wall_s": time.perf_counter() - started,
        },
        "passed": bool(passed),
    }
