"""The micro-batch shapes whose peak memory matters, from the training settings and the plans.

- the training shape: `micro_batch_size` x `max_seq_len` (every row full: no padding);
- the p99 length: `micro_batch_size` rows of the 99th-percentile training example's tokens;
- each strategy's largest micro-batch over its whole plan (`probes.batching.plans`, written by the
  bucket stage): the one with the most computed positions (rows x padded length, or the documents
  of a packed row), the longer padded length on a tie. A packed micro-batch is one flattened row.
  batch_rebalance's plan is among them: its micro-batches vary in rows, up to
  micro_batch_size x grad_accum.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from probes.batching.plans import BASELINE
from probes.batching.plans import PACKED as PLAN_PACKED
from probes.contracts import BATCH_REBALANCE
from probes.errors import ProbeError
from probes.memory.predict import PACKED, PADDED, Shape

TRAINING, P99 = "training", "p99"
PLAN_COLUMNS = ("strategy", "layout", "rows", "padded_length", "computed_tokens", "loss_tokens")


class ShapesError(ProbeError, ValueError):
    """Plans the memory stage cannot read; the message names the file and column."""


def training_shape(micro_batch_size: int, max_seq_len: int) -> Shape:
    """`micro_batch_size` full rows of `max_seq_len` tokens (loss on every position: worst case)."""
    return Shape(TRAINING, int(micro_batch_size), int(max_seq_len))


def quantile_length(plans: pd.DataFrame, quantile: float, origin: str = "plans") -> int:
    """The `quantile` of the training examples' lengths (each example once: the random plan)."""
    if not 0 < quantile <= 1:
        raise ShapesError(f"memory.length_quantile: {quantile} is not in (0, 1]")
    lengths = _example_lengths(plans, origin)
    return int(np.quantile(lengths, quantile, method="higher"))


def _example_lengths(plans: pd.DataFrame, origin: str) -> np.ndarray:
    if "example_lengths" not in plans.columns:
        raise ShapesError(f"{origin}: column 'example_lengths' missing; rerun the bucket stage")
    one = _one_epoch(plans)
    values = [int(x) for row in one["example_lengths"] for x in row]
    if not values:
        raise ShapesError(f"{origin}: no training example in the plans")
    return np.asarray(values)


def rebalance_shape(
    plans: pd.DataFrame, micro_batch_size: int, grad_accum: int, seed: int
) -> Shape | str:
    """batch_rebalance's largest micro-batch over an epoch (transformers' own sampler on the
    plan's examples, each once), or why there is none: for plans written without a
    batch_rebalance plan (the bucket stage now writes one, which largest_micro_batches reads)."""
    from probes.batching import rebalance

    one = _one_epoch(plans)
    lengths = np.asarray([int(x) for row in one["example_lengths"] for x in row])
    loss = np.asarray([int(x) for row in one["example_loss_tokens"] for x in row])
    reason = rebalance.skip_reason(int(lengths.size), int(grad_accum))
    if reason is not None:
        return reason
    batches = rebalance.rebalance_micro_batches(lengths, micro_batch_size, grad_accum, seed)
    largest = max(batches, key=lambda b: (len(b) * int(lengths[b].max()), int(lengths[b].max())))
    return Shape(
        BATCH_REBALANCE,
        len(largest),
        int(lengths[largest].max()),
        PADDED,
        int(loss[largest].sum()),
    )


def _one_epoch(plans: pd.DataFrame) -> pd.DataFrame:
    """The baseline plan (random batches): every training example once."""
    names = set(plans["strategy"])
    name = BASELINE if BASELINE in names else (plans["strategy"].iloc[0] if len(plans) else None)
    return plans[plans["strategy"] == name]


def quantile_shape(plans: pd.DataFrame, micro_batch_size: int, quantile: float) -> Shape:
    return Shape(P99, int(micro_batch_size), quantile_length(plans, quantile))


def largest_micro_batches(plans: pd.DataFrame, origin: str = "plans") -> dict[str, Shape]:
    """strategy -> its largest micro-batch (most computed positions; longer rows on a tie)."""
    missing = [c for c in PLAN_COLUMNS if c not in plans.columns]
    if missing:
        raise ShapesError(f"{origin}: column(s) {missing} missing; rerun the bucket stage")
    out: dict[str, Shape] = {}
    for strategy, group in plans.groupby("strategy", sort=False):
        ranked = group.sort_values(
            ["computed_tokens", "padded_length"], ascending=False, kind="stable"
        )
        row = ranked.iloc[0]
        if row["layout"] == PLAN_PACKED:
            shape = Shape(
                str(strategy), 1, int(row["computed_tokens"]), PACKED, int(row["loss_tokens"])
            )
        else:
            shape = Shape(
                str(strategy),
                int(row["rows"]),
                int(row["padded_length"]),
                PADDED,
                int(row["loss_tokens"]),
            )
        out[str(strategy)] = shape
    return out
