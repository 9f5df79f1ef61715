"""transformers' ``batch_rebalance`` sampler, measured on the user's lengths like any sweep row.

``TrainingArguments(train_sampling_strategy="batch_rebalance")`` (transformers ≥ 5) makes the
Trainer build ``trainer_pt_utils.BatchRebalanceSampler``: per optimizer step it takes
``micro_batch_size × grad_accum`` shuffled examples, sorts them by length and splits them into
``grad_accum`` micro-batches of *varying* size that balance a fixed cost model
``bs·max_len + 0.001·bs·max_len²``. The micro-batches here come from that very class (not a
re-implementation), iterated exactly as the Trainer's DataLoader does (as a batch sampler), and are
scored with the sweep's own ``batch_metrics.padded_metrics``, so its row compares with the others.

Its shuffle is ``torch.randperm(n, generator=Generator().manual_seed(seed + epoch))``: with
``seed=s`` (epoch 0) it draws the very permutation the sweep's seed ``s`` uses
(``orders.seeded_permutation``), so rows of one seed are paired. The Trainer itself does not pass
``args.seed``; it uses the class default 42 (``Trainer._get_train_sampler``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from probes.batching import metrics as batch_metrics
from probes.contracts import BATCH_REBALANCE
from probes.lengths import LengthSet

STRATEGY = BATCH_REBALANCE
# The Trainer keeps the tail (dataloader_drop_last defaults to False), so the rows compare with
# the sweep's, which batch every example.
TRAINER_DROP_LAST = False


def rebalance_sampler_class() -> type | None:
    """transformers' BatchRebalanceSampler, or None where the installed version has none (< 5)."""
    try:
        from transformers.trainer_pt_utils import BatchRebalanceSampler
    except ImportError:
        return None
    return BatchRebalanceSampler


def unavailable_reason() -> str | None:
    """Why the batch_rebalance row cannot be computed here, or None when it can."""
    if rebalance_sampler_class() is None:
        import transformers

        return (
            f"transformers {transformers.__version__} has no "
            "trainer_pt_utils.BatchRebalanceSampler (added in 5.x); no batch_rebalance row"
        )
    return None


def skip_reason(n_examples: int, grad_accum: int) -> str | None:
    """Why the batch_rebalance row is left out for this data, or None when it can be computed:
    the installed transformers lacks the sampler, or there are fewer usable examples than
    ``grad_accum`` (the sampler splits each step into ``grad_accum`` non-empty micro-batches)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if n_examples < grad_accum:
        return (
            f"batch_rebalance needs at least training.grad_accum={grad_accum} usable examples, "
            f"got {n_examples}; no batch_rebalance row (use more data or a smaller grad_accum)"
        )
    return None


def rebalance_micro_batches(
    lengths: np.ndarray,
    micro_batch_size: int,
    grad_accum: int,
    seed: int,
    epoch: int = 0,
    drop_last: bool = TRAINER_DROP_LAST,
) -> list[list[int]]:
    """Micro-batches (lists of example indices) exactly as the Trainer's batch_rebalance yields
    them on one process: ``effective_batch_size = micro × grad_accum``, ``dp_size = 1``."""
    sampler_class = rebalance_sampler_class()
    if sampler_class is None:
        raise RuntimeError(unavailable_reason())
    effective = int(micro_batch_size) * int(grad_accum)
    if lengths.size < grad_accum:
        raise ValueError(
            f"batch_rebalance needs at least grad_accum={grad_accum} examples, got {lengths.size}"
        )
    sampler = sampler_class(
        lengths=[int(x) for x in lengths],
        effective_batch_size=effective,
        dp_size=1,
        grad_accum=int(grad_accum),
        shuffle=True,
        seed=int(seed),
        rank=0,
        drop_last=drop_last,
    )
    sampler.set_epoch(int(epoch))
    return [list(map(int, batch)) for batch in sampler]


def trainer_seed() -> int:
    """The seed the Trainer's BatchRebalanceSampler shuffles with: the class's own default
    (``Trainer._get_train_sampler`` passes none, whatever ``args.seed`` is)."""
    import inspect

    sampler_class = rebalance_sampler_class()
    if sampler_class is None:
        raise RuntimeError(unavailable_reason())
    return int(inspect.signature(sampler_class).parameters["seed"].default)


def trainer_micro_batches(
    lengths: np.ndarray, micro_batch_size: int, grad_accum: int, epoch: int = 0
) -> list[list[int]]:
    """The micro-batches a single-process Trainer with ``train_sampling_strategy=
    "batch_rebalance"`` feeds in epoch ``epoch`` (its sampler's own seed, the Trainer's
    ``dataloader_drop_last`` default)."""
    return rebalance_micro_batches(lengths, micro_batch_size, grad_accum, trainer_seed(), epoch)


def rebalance_order(
    lengths: np.ndarray, micro_batch_size: int, grad_accum: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(example order, rows per micro-batch) of batch_rebalance's epoch 0 with this seed."""
    batches = rebalance_micro_batches(lengths, micro_batch_size, grad_accum, seed)
    order = np.fromiter((i for batch in batches for i in batch), dtype=np.int64)
    rows = np.fromiter((len(batch) for batch in batches), dtype=np.int64, count=len(batches))
    return order, rows


def rebalance_metrics(
    data: LengthSet, micro_batch_size: int, grad_accum: int, seed: int
) -> dict[str, Any]:
    """The sweep's metrics (``batch_metrics.padded_metrics``) of batch_rebalance's micro-batches.

    Adds ``examples_fed``: with ``drop_last=False`` a tail smaller than ``grad_accum`` is padded
    with repeated examples (as the sampler does), so it may exceed the dataset by < grad_accum.
    """
    order, rows = rebalance_order(data.lengths, micro_batch_size, grad_accum, seed)
    metrics = batch_metrics.padded_metrics(
        data.lengths[order],
        data.sources[order],
        micro_batch_size,
        grad_accum,
        data.n_sources,
        rows_per_micro_batch=rows,
    )
    return {**metrics, "examples_fed": int(order.size)}
