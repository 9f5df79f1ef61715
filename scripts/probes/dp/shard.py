"""Which rank runs which micro-batch of a plan, per optimizer step (pure, no torch).

The sharding is ``probes.batching.ranks``' (accelerate's ``BatchSamplerShard`` with
``even_batches``): the single-process order is extended to a multiple of ``W`` micro-batches,
global micro-batch ``i`` runs on rank ``i % W``, and step ``s`` of a rank holds its local
micro-batches ``[s × grad_accum, (s + 1) × grad_accum)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from probes.batching import ranks

# plan[rank][step] = that step's micro-batches on that rank, each a list of unit indices
RankPlan = list[list[list[list[int]]]]


def rank_plans(n_units: int, micro: int, grad_accum: int, world: int) -> RankPlan:
    """plan[rank][step][k] = the unit indices (positions in the single-process order) of the
    k-th micro-batch of that step on that rank."""
    fed = ranks.even_batches_order(np.arange(n_units), micro, world)
    batches = [fed[i : i + micro].tolist() for i in range(0, fed.size, micro)]
    owner = ranks.rank_of_micro_batch(len(batches), world)
    plan: RankPlan = []
    for rank in range(world):
        local = [b for b, o in zip(batches, owner, strict=True) if o == rank]
        plan.append([local[s : s + grad_accum] for s in range(0, len(local), grad_accum)])
    return plan


def map_plan(plan: RankPlan, values: Sequence[int]) -> RankPlan:
    """The same plan with every unit index replaced by ``values[index]`` (e.g. its length)."""
    return [[[[int(values[i]) for i in batch] for batch in step] for step in r] for r in plan]


def sample_steps(n_steps: int, k: int) -> list[int]:
    """``k`` optimizer steps spread evenly over ``n_steps`` (all of them when ``k >= n_steps``):
    first, last and evenly spaced between, so long and short stretches of an order both count."""
    if n_steps <= 0 or k <= 0:
        return []
    if k >= n_steps:
        return list(range(n_steps))
    return sorted({int(round(v)) for v in np.linspace(0, n_steps - 1, k)})


def common_steps(plan: RankPlan) -> int:
    """Steps every rank runs (equal under even_batches; the minimum guards a ragged tail)."""
    return min(len(r) for r in plan) if plan else 0
