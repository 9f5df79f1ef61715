"""Batch plans: for one seed, the micro-batches every candidate batching strategy hands the model.

A plan row is one micro-batch: its shape (rows × padded length, or the documents of a packed
micro-batch), its real and loss tokens, and the ids of its examples (ids only, never text). The
replay (probes.replay.stage) times a stratified sample of these real shapes through the harness.

The orders are the bucket stage's own: ``probes.batching.orders.seeded_permutation`` (HF's shuffle),
``length_grouped_order`` (HF's get_length_grouped_indices) and ``probes.batching.packing``
(TRL's own ``pack_dataset``).

Strategies:

- ``random``: shuffled micro-batches, each padded to its longest row (the baseline);
- ``length_grouped``: HF length grouping at the bucket stage's recommended bucket size;
- ``group_by_length_builtin``: transformers' own ``train_sampling_strategy="group_by_length"``
  (its sampler at the Trainer's default megabatch), the setting recommendations.json emits;
- ``batch_rebalance``: transformers' own ``train_sampling_strategy="batch_rebalance"``: the
  micro-batches its ``BatchRebalanceSampler`` yields as the Trainer builds it (its own seed, not
  the plan's; ``micro_batch_size × grad_accum`` examples per step in micro-batches of varying
  rows, a tail smaller than ``grad_accum`` filled with repeated examples, as the sampler does);
  left out where the installed transformers has no such sampler or there are fewer examples
  than ``grad_accum`` (``probes.batching.rebalance.skip_reason``);
- ``global_sort``: length grouping with one megabatch holding the whole dataset;
- ``packing``: whole examples packed into ``max_seq_len`` rows by TRL's
  ``pack_dataset(strategy="bfd")``, rows shuffled, at the batch shape the packing change pastes
  (``packing.packed_batch_shape``: rows per micro-batch and its own grad_accum, tokens per update
  kept), the documents of a row in TRL's order; a packed micro-batch is laid out as one
  flattened row of its documents with position ids restarting at 0 per document and no padding
  (the layout of DataCollatorWithFlattening / TRL ``padding_free``);
- ``pad_to_max_seq_len``: the random order, every micro-batch padded to ``max_seq_len``; left
  out where the user's trainer collates the examples (``trainer.factory``): its collator, checked
  by the padding stage, pads each batch to its longest member, so the advice it prices ("pad to
  the longest member, if you pad to max_seq_len today") does not apply to this run;
- ``random_no_idle``: the random order without the examples that carry no loss token; left out
  where every example carries one (its micro-batches would be random's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import orders, packing, rebalance
from probes.contracts import (
    BATCH_REBALANCE,
    GLOBAL_SORT,
    GROUP_BY_LENGTH_BUILTIN,
    LENGTH_GROUPED,
    PACKING,
    RANDOM,
    RANDOM_NO_IDLE,
    TRAINER_DATASET_FILE,
    TRAINING_STATUSES,
)
from probes.contracts import PAD_TO_MAX_SEQ_LEN as PAD_TO_MAX
from probes.errors import ProbeError
from probes.lengths import read_lengths

STRATEGIES = (
    RANDOM,
    LENGTH_GROUPED,
    GROUP_BY_LENGTH_BUILTIN,
    BATCH_REBALANCE,
    GLOBAL_SORT,
    PACKING,
    PAD_TO_MAX,
    RANDOM_NO_IDLE,
)
BASELINE = RANDOM
PADDED, PACKED = "padded", "packed"

PLAN_COLUMNS = (
    "strategy",
    "micro_batch_index",
    "optimizer_step_index",
    "layout",  # padded: rows × padded_length, right padding; packed: one flattened row
    "rows",  # examples (padded) or max_seq_len bins (packed) in the micro-batch
    "padded_length",  # longest row (padded), max_seq_len (packed bins)
    "computed_tokens",  # positions the model runs over: rows × padded_length, or Σ documents
    "real_tokens",
    "loss_tokens",
    "n_examples",
    "example_ids",  # list<str>: the padding stage's example ids, in row/document order
    "example_lengths",  # list<int>: tokens per example, same order
    "example_loss_tokens",  # list<int>
    "documents_per_row",  # list<int>: examples per row (1 each when padded; per bin when packed)
)


class PlanInputError(ProbeError, ValueError):
    """The plan's inputs are unusable; the message names the file, key and what to do."""


@dataclass(frozen=True)
class PlanExamples:
    """The training examples in the padding stage's row order (OK and TRUNCATED only)."""

    example_ids: np.ndarray  # object (str)
    lengths: np.ndarray  # int64, tokens kept (≤ max_seq_len)
    loss_tokens: np.ndarray  # int64, ≤ lengths
    # the rows of the user's trainer's own dataset, which its own collator pads (to each batch's
    # longest member: the padding stage checked it), not to max_seq_len
    trainer_collated: bool = False


def read_examples(path: str | Path, max_seq_len: int) -> PlanExamples:
    """The lengths table through the bucket stage's own reader and checks, plus ids and loss
    tokens (which the bucket stage's LengthSet does not keep)."""
    path = Path(path)
    read_lengths(path, max_seq_len)  # the same contract and error messages as the sweep
    frame = pd.read_parquet(
        path, columns=["example_id", "file", "status", "n_tokens", "n_loss_tokens"]
    )
    used = frame.loc[frame["status"].astype(str).isin(TRAINING_STATUSES)]
    lengths = used["n_tokens"].to_numpy(dtype=np.int64)
    loss = pd.to_numeric(used["n_loss_tokens"], errors="coerce").fillna(0).to_numpy(np.int64)
    return PlanExamples(
        example_ids=used["example_id"].astype(str).to_numpy(dtype=object),
        lengths=lengths,
        loss_tokens=np.clip(loss, 0, lengths),
        trainer_collated=bool(len(used)) and bool((used["file"] == TRAINER_DATASET_FILE).all()),
    )


def recommended_bucket_size(recommendation: dict[str, Any], origin: str = "recommendation") -> int:
    try:
        return int(recommendation["recommended"]["bucket_size_batches"])
    except (KeyError, TypeError, ValueError) as error:
        raise PlanInputError(
            f"{origin}: no recommended.bucket_size_batches ({error!r}); rerun bucket_sweep."
        ) from error


def _in_micro_batches(order: np.ndarray, micro_batch_size: int) -> list[np.ndarray]:
    """An example order cut into consecutive micro-batches of ``micro_batch_size`` (the last
    one shorter), as a DataLoader's batch sampler does with drop_last off."""
    return [
        order[start : start + micro_batch_size] for start in range(0, order.size, micro_batch_size)
    ]


def _padded_plan(
    strategy: str,
    micro_batches: list[np.ndarray],
    examples: PlanExamples,
    pad_to: int | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for index, members in enumerate(micro_batches):
        lengths = examples.lengths[members]
        padded = int(pad_to) if pad_to is not None else int(lengths.max())
        rows.append(
            {
                "strategy": strategy,
                "micro_batch_index": index,
                "layout": PADDED,
                "rows": int(members.size),
                "padded_length": padded,
                "computed_tokens": int(members.size) * padded,
                "real_tokens": int(lengths.sum()),
                "loss_tokens": int(examples.loss_tokens[members].sum()),
                "n_examples": int(members.size),
                "example_ids": [str(v) for v in examples.example_ids[members]],
                "example_lengths": [int(v) for v in lengths],
                "example_loss_tokens": [int(v) for v in examples.loss_tokens[members]],
                "documents_per_row": [1] * int(members.size),
            }
        )
    return rows


def _packed_plan(
    examples: PlanExamples,
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    seed: int,
    packed: packing.PackedRows | None = None,
) -> list[dict[str, Any]]:
    """TRL's packed rows, shuffled, at the shape the packing change pastes (rows per micro-batch
    and grad_accum keeping tokens per update: packing.packed_batch_shape)."""
    if packed is None:
        packed = packing.pack(examples.lengths, max_seq_len, packing.BFD)
    n_bins = packed.n_rows
    per_micro, accum = packing.packed_batch_shape(
        micro_batch_size, grad_accum, max_seq_len, int(examples.lengths.size),
        int(examples.lengths.sum()), int(examples.lengths.max()), n_bins,
    )  # fmt: skip
    bin_order = orders.seeded_permutation(n_bins, seed)
    rows = []
    for index, start in enumerate(range(0, n_bins, per_micro)):
        bins = bin_order[start : start + per_micro]
        members = [packed.row(int(b)) for b in bins]
        flat = np.concatenate(members)
        lengths = examples.lengths[flat]
        rows.append(
            {
                "strategy": PACKING,
                "micro_batch_index": index,
                "optimizer_step_index": index // accum,
                "layout": PACKED,
                "rows": int(bins.size),
                "padded_length": int(max_seq_len),
                "computed_tokens": int(lengths.sum()),
                "real_tokens": int(lengths.sum()),
                "loss_tokens": int(examples.loss_tokens[flat].sum()),
                "n_examples": int(flat.size),
                "example_ids": [str(v) for v in examples.example_ids[flat]],
                "example_lengths": [int(v) for v in lengths],
                "example_loss_tokens": [int(v) for v in examples.loss_tokens[flat]],
                "documents_per_row": [int(m.size) for m in members],
            }
        )
    return rows


def _check_plan_inputs(
    lengths: np.ndarray, micro_batch_size: int, grad_accum: int, max_seq_len: int
) -> None:
    if micro_batch_size < 1 or grad_accum < 1:
        raise PlanInputError(
            f"micro_batch_size={micro_batch_size}, grad_accum={grad_accum}: both must be >= 1"
        )
    if lengths.size == 0:
        raise PlanInputError("no training example: nothing to plan")
    if int(lengths.max()) > max_seq_len:
        raise PlanInputError(
            f"an example has {int(lengths.max())} tokens > max_seq_len={max_seq_len}; cap the "
            "lengths first (the padding stage does)"
        )


def _rebalance_micro_batches(
    lengths: np.ndarray, micro_batch_size: int, grad_accum: int
) -> list[np.ndarray]:
    """transformers' batch_rebalance as the Trainer yields it; none where it cannot run here."""
    if rebalance.skip_reason(int(lengths.size), grad_accum) is not None:
        return []
    batches = rebalance.trainer_micro_batches(lengths, micro_batch_size, grad_accum)
    return [np.asarray(batch, dtype=np.int64) for batch in batches]


def build_plans(
    examples: PlanExamples,
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    bucket_size_batches: int,
    seed: int = 0,
    packed: packing.PackedRows | None = None,
) -> pd.DataFrame:
    """Every strategy's micro-batches for one seed (one row per micro-batch, PLAN_COLUMNS).

    ``packed``: TRL's bfd rows of these very examples where the caller has them already."""
    lengths = examples.lengths
    _check_plan_inputs(lengths, micro_batch_size, grad_accum, max_seq_len)
    n = lengths.size
    perm = orders.seeded_permutation(n, seed)
    m_all = orders.all_bucket_size(n, micro_batch_size)
    m_rec = min(max(int(bucket_size_batches), 1), m_all)
    # transformers' own group_by_length (recommendations.json emits it): its sampler's order at
    # the Trainer's default megabatch (micro × grad_accum × min(n // (4 × that), 50))
    m_hf = min(orders.hf_trainer_mega_batch_mult(n, micro_batch_size, grad_accum), m_all)
    kept = np.flatnonzero(examples.loss_tokens > 0)

    def grouped(m: int) -> list[np.ndarray]:
        return _in_micro_batches(
            orders.length_grouped_order(lengths, perm, micro_batch_size, m), micro_batch_size
        )

    # the Trainer's own random sampler: the shuffle itself, micro-batches in its order (a test
    # compares them with a real Trainer's dataloader, batch for batch)
    random_batches = _in_micro_batches(perm, micro_batch_size)
    rows = _padded_plan(RANDOM, random_batches, examples)
    rows += _padded_plan(LENGTH_GROUPED, grouped(m_rec), examples)
    rows += _padded_plan(GROUP_BY_LENGTH_BUILTIN, grouped(m_hf), examples)
    # transformers' own batch_rebalance (recommendations.json emits it): what its sampler yields
    rebalanced = _rebalance_micro_batches(lengths, micro_batch_size, grad_accum)
    rows += _padded_plan(BATCH_REBALANCE, rebalanced, examples)
    rows += _padded_plan(GLOBAL_SORT, grouped(m_all), examples)
    rows += _packed_plan(examples, micro_batch_size, grad_accum, max_seq_len, seed, packed)
    # none for a user's trainer: its collator pads to the longest member (not max_seq_len), so the
    # replay would time a setup this run does not have, for advice that does not apply
    if not examples.trainer_collated:
        rows += _padded_plan(PAD_TO_MAX, random_batches, examples, pad_to=max_seq_len)
    # the Trainer's random sampler over the filtered dataset; none where nothing is filtered (a
    # trainer that drops fully masked examples itself): its micro-batches would be random's, one
    # for one, and timing them again would cost the replay a strategy's samples for a known 0
    if kept.size < n:
        no_idle = kept[orders.seeded_permutation(kept.size, seed)]
        rows += _padded_plan(RANDOM_NO_IDLE, _in_micro_batches(no_idle, micro_batch_size), examples)
    frame = pd.DataFrame(rows)
    # packing's rows carry their own (its grad_accum keeps tokens per update); the rest grad_accum
    own = frame.get("optimizer_step_index")
    default = frame["micro_batch_index"] // grad_accum
    frame["optimizer_step_index"] = (default if own is None else own.fillna(default)).astype(int)
    frame.attrs["bucket_size_batches"] = m_rec
    return frame[list(PLAN_COLUMNS)]


def plan_summary(plans: pd.DataFrame) -> pd.DataFrame:
    """Per strategy: micro-batches, optimizer steps, tokens (exact, over the whole plan)."""
    grouped = plans.groupby("strategy", sort=False)
    summary = grouped.agg(
        micro_batches=("micro_batch_index", "size"),
        optimizer_steps=("optimizer_step_index", "nunique"),
        examples=("n_examples", "sum"),
        real_tokens=("real_tokens", "sum"),
        loss_tokens=("loss_tokens", "sum"),
        computed_tokens=("computed_tokens", "sum"),
    )
    summary["tokens_per_optimizer_step"] = summary["real_tokens"] / summary["optimizer_steps"]
    summary["real_tokens_per_micro_batch"] = summary["real_tokens"] / summary["micro_batches"]
    return summary.reset_index()


def grad_accum_for_same_tokens(
    tokens_per_micro_batch: float, baseline_tokens_per_micro_batch: float, grad_accum: int
) -> int:
    """The grad_accum that keeps real tokens per optimizer update closest to the baseline's
    (at least 1: a strategy with more tokens per micro-batch than a whole baseline update needs a
    smaller micro-batch instead)."""
    if tokens_per_micro_batch <= 0 or not math.isfinite(tokens_per_micro_batch):
        return grad_accum
    return max(1, round(grad_accum * baseline_tokens_per_micro_batch / tokens_per_micro_batch))


def bucket_stage_plans(
    lengths_path: str | Path,
    recommendation: dict[str, Any],
    training: Any,
    seed: int = 0,
    packed: packing.PackedRows | None = None,
) -> pd.DataFrame:
    """The bucket stage's one call: every strategy's plan at the recommended bucket size.
    `training` is the typed training section (micro_batch_size, grad_accum, max_seq_len);
    `packed`: the sweep's bfd rows of the same examples (same reader, same order), if packed."""
    max_seq_len = int(training.max_seq_len)
    return build_plans(
        read_examples(lengths_path, max_seq_len),
        micro_batch_size=int(training.micro_batch_size),
        grad_accum=int(training.grad_accum),
        max_seq_len=max_seq_len,
        bucket_size_batches=recommended_bucket_size(recommendation),
        seed=seed,
        packed=packed,
    )


def read_plans(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise PlanInputError(f"{path}: no such file; it is written by the bucket_sweep rule.")
    frame = pd.read_parquet(path)
    missing = [c for c in PLAN_COLUMNS if c not in frame.columns]
    if missing:
        raise PlanInputError(
            f"{path}: missing column(s) {missing}; rerun the bucket_sweep rule (plans.parquet)."
        )
    if BASELINE not in set(frame["strategy"]):
        raise PlanInputError(f"{path}: no '{BASELINE}' plan, the baseline every saving needs.")
    return frame


def rehearsal_length(lengths: Any, cap: int, max_seq_len: int) -> np.ndarray:
    """A CPU rehearsal's length of each example: its length (cut at `max_seq_len`) scaled by
    cap / max_seq_len, rounded up, at least 2 where it had 2. Scaling instead of cutting keeps
    the data's shape: every micro-batch keeps its examples, and the padding waste, the packing
    and the micro-batch counts stay near the real run's (cut at the cap, most examples of the
    default data reached it and no batching change could save anything). A row of one token
    has no next token to predict, so it trains nothing: on the default run on CPU, micro-batches
    of such rows took half the time the working model gave them (-50% residuals, all in the
    sorting strategies' shortest stratum), which no real micro-batch of theirs does."""
    full = np.minimum(np.asarray(lengths, dtype=np.int64), int(max_seq_len))
    scaled = np.ceil(full * (float(cap) / float(max_seq_len))).astype(np.int64)
    return np.clip(scaled, np.minimum(np.maximum(full, 1), 2), int(cap))


def rehearsal_examples(examples: PlanExamples, cap: int, max_seq_len: int) -> PlanExamples:
    """Examples at a CPU rehearsal's lengths (rehearsal_length), each one's loss tokens scaled
    with it (at least 1 where it has any); unchanged when `cap` is not below `max_seq_len`."""
    if cap >= max_seq_len:
        return examples
    lengths = rehearsal_length(examples.lengths, cap, max_seq_len)
    full = np.maximum(np.minimum(examples.lengths, max_seq_len), 1)
    loss = np.minimum(examples.loss_tokens, full)
    scaled = np.round(loss * lengths / full).astype(np.int64)
    loss = np.where(loss > 0, np.clip(scaled, 1, lengths), 0)
    return dataclasses.replace(examples, lengths=lengths, loss_tokens=loss)


def batch_shape(row: Any) -> tuple[int, int]:
    """(rows, length) of the tensor the model sees: rows × padded length, or one flattened row."""
    if row.layout == PACKED:
        return 1, int(row.computed_tokens)
    return int(row.rows), int(row.padded_length)
