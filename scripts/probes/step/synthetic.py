"""A synthetic harness of known cost: a StepRunner whose compute_loss and optimizer
step wait out a known function of the batch shape (``SyntheticCost``), and the analytic epoch
time of a plan at that cost (``exact_epoch_s``). The replay's positive control
(``probes.replay.control``) and the realize control time through it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching import plans as pl

SPIN_TAIL_S = 0.0003


def wait_until(deadline: float) -> None:
    """Wait until perf_counter() reaches `deadline`: sleep all but the last 0.3 ms, then spin.

    A pure spin is preempted on a shared machine (measured: a 5 ms spin took 12 ms median at load
    8 on 2 cores), and its overshoot would be the machine's load, not the known cost; a sleeping
    thread is rescheduled promptly (same load: 5.003 ms median), and the spin makes it exact.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_TAIL_S:
        time.sleep(remaining - SPIN_TAIL_S)
    while time.perf_counter() < deadline:
        pass


def busy_wait(seconds: float) -> None:
    wait_until(time.perf_counter() + seconds)


@dataclass(frozen=True)
class SyntheticCost:
    """Step cost in seconds: c + b·rows·T + a·rows·T² per micro-batch; a fixed optimizer step."""

    a: float
    b: float
    c: float
    optimizer_s: float

    def micro_batch_s(self, rows: int, length: int) -> float:
        return self.c + self.b * rows * length + self.a * rows * length * length

    @classmethod
    def scaled_to(
        cls,
        plans: pd.DataFrame,
        fixed_s: float = 0.004,
        linear_s: float = 0.003,
        quadratic_s: float = 0.003,
        optimizer_s: float = 0.002,
    ) -> SyntheticCost:
        """Coefficients that give each term `*_s` at the plan's largest padded micro-batch (the
        fit's largest shape too), so every term is a real share of the step (a term lost in
        timer noise would test nothing); flattened packed rows may cost more."""
        padded = plans[plans["layout"] == pl.PADDED]
        shapes = np.array(
            [pl.batch_shape(r) for r in (padded if len(padded) else plans).itertuples()],
            dtype=np.float64,
        )
        linear = float(np.max(shapes[:, 0] * shapes[:, 1]))
        quadratic = float(np.max(shapes[:, 0] * shapes[:, 1] ** 2))
        return cls(quadratic_s / quadratic, linear_s / linear, fixed_s, optimizer_s)


def exact_epoch_s(plans: pd.DataFrame, cost: SyntheticCost, grad_accum: int) -> pd.Series:
    """The analytic epoch time of every strategy over its whole plan."""
    totals = {}
    for name, plan in plans.groupby("strategy", sort=False):
        micro = sum(cost.micro_batch_s(*pl.batch_shape(r)) for r in plan.itertuples())
        # a plan's own optimizer steps where it numbers them (a micro-batch-size change keeps
        # tokens per update with its own gradient accumulation), else grad_accum micro-batches each
        if "optimizer_step_index" in plan:
            steps = int(plan["optimizer_step_index"].nunique())
        else:
            steps = -(-len(plan) // grad_accum)
        totals[name] = micro + steps * cost.optimizer_s
    return pd.Series(totals)


class _SyntheticLoss:
    """What the synthetic compute_loss returns: its backward() ends at the micro-batch's known
    deadline (no autograd graph: the engine's own ~0.3 ms per call on a loaded machine would be
    an unknown cost inside a known one)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def backward(self) -> None:
        wait_until(self.deadline)


class _SyntheticModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))


class _BusyOptimizer(torch.optim.SGD):
    def __init__(self, params: Any, seconds: float) -> None:
        super().__init__(params, lr=0.0)
        self.seconds = seconds

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        self.deadline = time.perf_counter() + self.seconds
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        super().zero_grad(set_to_none=set_to_none)
        wait_until(getattr(self, "deadline", 0.0))  # step + zero_grad end at the known cost


def known_cost_runner(
    compute_loss: Any, optimizer: Any, model: torch.nn.Module, spec: str, module: str
) -> Any:
    """A StepRunner on CPU over a harness of one `compute_loss` (the known cost's), its
    `optimizer` over `model`: the steps of known cost the controls time (`spec` and `module`:
    the harness's name and the module that defines it)."""
    from probes.step.harness import Harness
    from probes.step.runner import StepRunner

    harness = Harness(
        spec=spec,
        module=sys.modules[module],
        source_file=sys.modules[module].__file__,
        discover_target_modules=lambda model: ["weight"],
        compute_loss=compute_loss,
    )
    return StepRunner(model, harness, optimizer, torch.device("cpu"))


def synthetic_runner(cost: SyntheticCost) -> Any:
    """A StepRunner over a synthetic harness: compute_loss spins for the known cost of the batch
    shape it is given, the optimizer step for the known optimizer cost."""

    def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> _SyntheticLoss:
        start = time.perf_counter()
        rows, length = batch["input_ids"].shape
        return _SyntheticLoss(start + cost.micro_batch_s(int(rows), int(length)))

    model = _SyntheticModel()
    optimizer = _BusyOptimizer(model.parameters(), cost.optimizer_s)
    return known_cost_runner(
        compute_loss, optimizer, model, "probes.step.synthetic:synthetic", __name__
    )
