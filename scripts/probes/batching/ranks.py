"""Data-parallel plans: which rank runs which micro-batch, as the HF Trainer + accelerate do it,
and what each optimizer step then costs when it waits for the slowest rank.

Semantics read from the installed sources (transformers 5.24, accelerate 1.15):

- ``transformers.Trainer._get_dataloader`` builds ``DataLoader(dataset, batch_size=micro,
  sampler=self._get_train_sampler(), drop_last=args.dataloader_drop_last)`` and hands it to
  ``accelerator.prepare``. ``accelerate.data_loader.prepare_data_loader`` (``num_processes > 1``,
  no dispatch) wraps the DataLoader's batch sampler in ``BatchSamplerShard(split_batches=False,
  even_batches=True)`` (the Trainer's ``accelerator_config`` defaults). The sampler is the same on
  every rank (``SeedableRandomSampler`` for random; ``LengthGroupedSampler(batch_size=micro ×
  grad_accum)`` for ``group_by_length``, whose megabatch does not depend on the world size), so
  every rank sees one global sequence of micro-batches.
- ``BatchSamplerShard._iter_with_no_split``: global micro-batch ``i`` goes to rank ``i % W``.
  With ``even_batches=True`` and ``drop_last=False`` a short last micro-batch is completed, and
  the last round filled with whole micro-batches, from ``initial_data`` (the indices of the first
  ``W`` micro-batches, repeated while shorter than ``W × micro``), so every rank runs the same
  number of full micro-batches: the yielded sequence is consecutive ``micro``-sized chunks of
  ``order ++ initial_data ++ initial_data ...`` cut at a multiple of ``W`` micro-batches
  (``even_batches_order``; a test checks it against the class itself). With ``W == 1`` accelerate
  leaves the DataLoader alone (the short last micro-batch stays short).
- ``batch_rebalance``: ``Trainer._get_train_sampler`` builds ``BatchRebalanceSampler(
  effective_batch_size=micro × grad_accum × W, dp_size=W, grad_accum, rank=process_index,
  drop_last=args.dataloader_drop_last)``, passes it as the DataLoader's ``batch_sampler``, and
  after ``prepare`` resets the wrapping shard to ``num_processes=1`` (no re-sharding): each rank
  runs exactly what its own sampler yields (``rebalance_rank_batches``).
- Gradient accumulation under DDP (``accelerator.accumulate`` → ``no_sync`` on all but the last
  micro-batch): ranks meet only at the all-reduce of a step's last backward, so a step's time is
  the maximum over ranks of the sum of that rank's ``grad_accum`` micro-batches. Step ``s`` of
  every rank holds its local micro-batches ``[s × grad_accum, (s + 1) × grad_accum)``.

Cost of a micro-batch (the sweep's dense view, ``probes.batching.metrics``): padded tokens
``rows × padded_length`` and attention ``rows × padded_length²`` (a packed bin is one row of
``max_seq_len``). The straggler cost of a plan at ``W`` is ``Σ_steps max_ranks`` of the step work;
against ``Σ_steps mean_ranks`` (what perfectly balanced ranks would take) it gives the straggler
overhead ``max / mean − 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from probes.errors import ProbeError

# The world sizes the bucket sweep reports (plus the configured one).
DP_WORLD_SIZES = (1, 2, 4, 8)
COST_KINDS = ("padded_tokens", "attention_cost")


class WorldSizeError(ProbeError, ValueError):
    """A world size the plans cannot be sharded over; the message says what to change."""


def check_world_size(world_size: int, origin: str = "training.world_size") -> int:
    if int(world_size) < 1:
        raise WorldSizeError(f"{origin}={world_size}: the number of ranks must be >= 1")
    return int(world_size)


def even_batches_order(ordered: np.ndarray, micro_batch_size: int, world_size: int) -> np.ndarray:
    """The units every rank's micro-batches hold, in global order, as accelerate yields them.

    ``ordered`` is the single-process order (example or bin indices). For ``W > 1`` this is
    ``BatchSamplerShard(even_batches=True, drop_last=False)``: ``order`` followed by as much of
    ``initial_data`` (the first ``W`` micro-batches' indices, doubled while shorter than
    ``W × micro``), cyclically, as makes ``ceil(ceil(n / micro) / W) × W`` full micro-batches.
    Global micro-batch ``i`` of the result (``[i × micro, (i + 1) × micro)``) runs on rank
    ``i % W``. For ``W == 1`` the order is returned unchanged.
    """
    ordered = np.asarray(ordered, dtype=np.int64)
    world_size = check_world_size(world_size)
    if world_size == 1 or ordered.size == 0:
        return ordered
    n_batches = -(-ordered.size // micro_batch_size)
    total = -(-n_batches // world_size) * world_size * micro_batch_size
    if total == ordered.size:
        return ordered
    initial = ordered[: world_size * micro_batch_size]
    while initial.size < world_size * micro_batch_size:
        initial = np.concatenate([initial, initial])
    extra = total - ordered.size
    repeats = -(-extra // initial.size)
    return np.concatenate([ordered, np.tile(initial, repeats)[:extra]])


def rank_of_micro_batch(n_micro_batches: int, world_size: int) -> np.ndarray:
    """Rank of each global micro-batch (round robin, accelerate's ``idx % num_processes``)."""
    return np.arange(n_micro_batches, dtype=np.int64) % check_world_size(world_size)


def padded_costs(
    unit_lengths: np.ndarray, micro_batch_size: int, world_size: int
) -> dict[str, np.ndarray]:
    """Per-rank micro-batch costs, shape (W, local micro-batches), of consecutive micro-batches
    of an ordering (``unit_lengths`` in the single-process order), after accelerate's sharding.

    ``unit_lengths`` are example lengths (padded layouts) or ``max_seq_len`` per packed bin."""
    lengths = np.asarray(unit_lengths, dtype=np.int64)
    fed = lengths[even_batches_order(np.arange(lengths.size), micro_batch_size, world_size)]
    starts = np.arange(0, fed.size, micro_batch_size)
    rows = np.diff(np.r_[starts, fed.size])
    longest = np.maximum.reduceat(fed, starts)
    per_batch = {"padded_tokens": rows * longest, "attention_cost": rows * longest * longest}
    return {kind: _by_rank(cost, world_size) for kind, cost in per_batch.items()}


def _by_rank(global_costs: np.ndarray, world_size: int) -> np.ndarray:
    """(W, local) matrix of a round-robin sharded cost sequence; a missing tail slot is 0 (only
    at W == 1 can the count not be a multiple of W, and then there is no missing slot)."""
    local = -(-global_costs.size // world_size)
    padded = np.zeros(local * world_size, dtype=np.int64)
    padded[: global_costs.size] = global_costs
    return padded.reshape(local, world_size).T


def batches_costs(batches: Sequence[Sequence[int]], lengths: np.ndarray) -> dict[str, np.ndarray]:
    """Costs of explicit micro-batches (lists of example indices), each padded to its longest."""
    rows = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    longest = np.fromiter(
        (int(lengths[list(b)].max()) for b in batches), dtype=np.int64, count=len(batches)
    )
    return {"padded_tokens": rows * longest, "attention_cost": rows * longest * longest}


def rebalance_rank_batches(
    lengths: np.ndarray,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    seed: int,
    drop_last: bool = False,
) -> list[list[list[int]]]:
    """Every rank's micro-batches under ``batch_rebalance`` at ``W`` ranks, each from its own
    ``BatchRebalanceSampler`` built as ``Trainer._get_train_sampler`` builds it."""
    from probes.batching.rebalance import rebalance_sampler_class, unavailable_reason

    sampler_class = rebalance_sampler_class()
    if sampler_class is None:
        raise RuntimeError(unavailable_reason())
    world_size = check_world_size(world_size)
    as_list = [int(x) for x in lengths]
    out = []
    for rank in range(world_size):
        sampler = sampler_class(
            lengths=as_list,
            effective_batch_size=int(micro_batch_size) * int(grad_accum) * world_size,
            dp_size=world_size,
            grad_accum=int(grad_accum),
            shuffle=True,
            seed=int(seed),
            rank=rank,
            drop_last=drop_last,
        )
        sampler.set_epoch(0)
        out.append([list(map(int, batch)) for batch in sampler])
    return out


def rebalance_costs(
    lengths: np.ndarray, micro_batch_size: int, grad_accum: int, world_size: int, seed: int
) -> dict[str, np.ndarray]:
    """Per-rank micro-batch costs (W, local) of ``batch_rebalance`` at ``W`` ranks."""
    per_rank = rebalance_rank_batches(lengths, micro_batch_size, grad_accum, world_size, seed)
    costs = [batches_costs(batches, lengths) for batches in per_rank]
    return {kind: np.stack([c[kind] for c in costs]) for kind in COST_KINDS}


def step_work(rank_costs: np.ndarray, grad_accum: int) -> np.ndarray:
    """(W, steps): each rank's work per optimizer step, the sum of its ``grad_accum`` local
    micro-batches (the last step may hold fewer)."""
    rank_costs = np.asarray(rank_costs)
    local = rank_costs.shape[1]
    starts = np.arange(0, local, grad_accum)
    return np.add.reduceat(rank_costs, starts, axis=1)


def straggler_cost(rank_costs: np.ndarray, grad_accum: int) -> dict[str, float | int]:
    """Σ over steps of the slowest rank's work, against the mean over ranks."""
    work = step_work(rank_costs, grad_accum)
    step_max = work.max(axis=0)
    step_mean = work.mean(axis=0)
    total_max, total_mean = int(step_max.sum()), float(step_mean.sum())
    return {
        "n_steps": int(work.shape[1]),
        "micro_batches_per_rank": int(rank_costs.shape[1]),
        "step_max_sum": total_max,
        "step_mean_sum": total_mean,
        "straggler_overhead": total_max / total_mean - 1.0 if total_mean > 0 else 0.0,
    }


def world_sizes_for(configured: int) -> list[int]:
    """The sweep's world sizes: 1, 2, 4, 8 and the configured one."""
    return sorted(set(DP_WORLD_SIZES) | {check_world_size(configured)})


def expected_max_of_uniform_choice(values: Sequence[int], k: int) -> float:
    """E[max] of ``k`` distinct draws without replacement from ``values`` (closed form through
    order statistics): Σ_i v_(i) × [C(i, k−1) / C(n, k)] over the sorted values, i = 0..n−1."""
    ordered = sorted(int(v) for v in values)
    n = len(ordered)
    total = math.comb(n, k)
    return sum(v * math.comb(i, k - 1) for i, v in enumerate(ordered)) / total
