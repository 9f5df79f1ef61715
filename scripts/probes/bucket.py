"""Bucket sweep: what length-grouped batching saves, at which bucket size, at what diversity cost.

Strategies, all measured on the same tokenised lengths (``results/padding/lengths.parquet``):

- ``random``: shuffled micro-batches (bucket size 1 micro-batch);
- ``length_grouped``: Hugging Face's ``get_length_grouped_indices`` semantics, vectorised: shuffle,
  cut into megabatches of ``m × micro_batch_size`` examples, sort each megabatch by length
  (descending, stable), keep megabatch order, move the longest megabatch head to the very front;
- ``global_sort``: the same with one megabatch holding the whole dataset;
- ``packing_ffd`` / ``packing_bfd``: whole examples packed into ``max_seq_len`` bins by first-fit or
  best-fit decreasing, bins shuffled, ``micro_batch_size`` bins per micro-batch.

Seeds: the shuffle is ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``, the very
call HF makes, so a seed here reproduces HF's ordering index for index (a control checks it).

Definitions (the same for every strategy, so rows compare):

- token efficiency = real tokens / tokens the model computes over (micro-batch rows × padded length;
  a packed bin counts ``max_seq_len``);
- attention efficiency = Σ L² / Σ rows × S², i.e. the useful share of what a dense attention
  kernel (SDPA/eager with a padding or block-diagonal mask) computes, S being the padded row
  length. A varlen kernel (flash-attn with cu_seqlens, padding-free) spends only Σ L² on either,
  so this column is the dense-kernel view;
- source diversity per batch: distinct sources and normalised entropy H / log(min(size, #sources)),
  each also relative to random batching with the same seed (1.0 when random has nothing to lose,
  e.g. one-source data);
- order-follows-length: Spearman correlation of micro-batch position with its padded length (the
  epoch-long trend), and lag-1 autocorrelation of padded length (neighbouring batches alike).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from probes.contracts import BATCH_REBALANCE, SKIPPED_STATUSES, STRATEGY_ORDER
from probes.errors import ProbeError
from probes.lengths import LengthSet

# HF's cap on mega_batch_mult when the Trainer leaves it unset.
HF_MAX_MEGA_BATCH_MULT = 50
PACKING_ALGORITHMS = ("ffd", "bfd")
ATTENTION_NOTE = (
    "attention efficiency = sum of squared example lengths / rows x padded length squared: what a "
    "dense kernel (SDPA/eager with a padding or block-diagonal mask) computes. A varlen kernel "
    "(flash-attn cu_seqlens, padding-free) spends only the useful part on padded and packed "
    "batches alike, which would make packing's attention efficiency 1.0."
)
# Megabatches at least this large are sorted row-wise (radix sort on uint16 keys); smaller ones in
# one global stable sort over (megabatch, -length). Both give the identical order.
_ROW_SORT_MIN = 64

OrderFn = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


class SweepCollapsedError(ProbeError, AssertionError):
    """The sweep did not vary with bucket size although the lengths say it must."""


# --------------------------------------------------------------------------------------------
# Orderings
# --------------------------------------------------------------------------------------------


def seeded_permutation(n: int, seed: int) -> np.ndarray:
    """HF's shuffle: ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``.

    Using torch rather than numpy makes seed s reproduce
    ``get_length_grouped_indices(..., generator=torch.Generator().manual_seed(s))`` exactly.
    """
    import torch  # imported here: the rest of the module needs numpy only

    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


def length_grouped_order(
    lengths: np.ndarray, perm: np.ndarray, batch_size: int, mega_batch_mult: int
) -> np.ndarray:
    """``transformers.trainer_pt_utils.get_length_grouped_indices`` given its shuffle ``perm``.

    Same result index for index, vectorised: megabatches of ``mega_batch_mult × batch_size``
    consecutive shuffled indices, each sorted by length descending (stable, as Python's sorted),
    then the longest megabatch head swapped with megabatch 0's head (OOM early, as HF does).
    """
    n = perm.size
    megabatch = batch_size * mega_batch_mult
    permuted = lengths[perm]
    top = int(permuted.max())
    desc_key = top - permuted  # ascending key == descending length; stable keeps shuffle order
    if megabatch >= _ROW_SORT_MIN and top < 2**16:
        full = n // megabatch * megabatch
        rows = desc_key[:full].astype(np.uint16).reshape(-1, megabatch)
        within = np.argsort(rows, axis=1, kind="stable")
        within += np.arange(0, full, megabatch, dtype=np.int64)[:, None]
        tail = np.argsort(desc_key[full:], kind="stable") + full
        positions = np.concatenate([within.ravel(), tail])
    else:
        megabatch_id = np.arange(n, dtype=np.int64) // megabatch
        positions = np.argsort(megabatch_id * (top + 1) + desc_key, kind="stable")
    order = perm[positions]
    heads = lengths[order[::megabatch]]
    longest = int(np.argmax(heads)) * megabatch  # first maximum, as torch.argmax
    order[0], order[longest] = order[longest], order[0]
    return order


def global_sort_collapse(
    lengths: np.ndarray, perm: np.ndarray, batch_size: int, mega_batch_mult: int
) -> np.ndarray:
    """The historical bug, kept to test the collapse guard: ignores the bucket size entirely."""
    return length_grouped_order(lengths, perm, batch_size, math.ceil(perm.size / batch_size))


def hf_trainer_mega_batch_mult(n: int, micro_batch_size: int, grad_accum: int) -> int:
    """Bucket size, in micro-batches, that HF's Trainer uses with group_by_length.

    The Trainer builds LengthGroupedSampler with batch = micro × grad_accum and leaves
    mega_batch_mult unset: min(n // (4 × batch), 50), at least 1.
    """
    batch = micro_batch_size * grad_accum
    mult = max(min(n // (batch * 4), HF_MAX_MEGA_BATCH_MULT), 1)
    return mult * grad_accum


def all_bucket_size(n: int, micro_batch_size: int) -> int:
    """The bucket size (in micro-batches) that holds the whole dataset: a global sort."""
    return max(math.ceil(n / micro_batch_size), 1)


def sweep_bucket_sizes_for(
    n: int, micro_batch_size: int, grad_accum: int, requested: Iterable[int] | None = None
) -> list[int]:
    """Bucket sizes to sweep: 1, 2, 4, ..., 50, HF Trainer's default, all (deduplicated).

    A requested list is clipped to [1, all]; 1 (random) and all (global sort) are always added:
    the gains are measured against the first and the best is usually the second.
    """
    m_all = all_bucket_size(n, micro_batch_size)
    if requested is None:
        sizes = {2**k for k in range(max(m_all.bit_length(), 1)) if 2**k < m_all}
        sizes |= {
            HF_MAX_MEGA_BATCH_MULT,
            hf_trainer_mega_batch_mult(n, micro_batch_size, grad_accum),
        }
    else:
        sizes = {int(m) for m in requested}
    sizes = {min(max(m, 1), m_all) for m in sizes} | {1, m_all}
    return sorted(sizes)


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def _decreasing_groups(lengths: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """Example indices grouped by equal length, longest first, each group in index order."""
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    starts = np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]])
    ends = np.r_[starts[1:], order.size]
    for start, end in zip(starts, ends, strict=True):
        yield int(sorted_lengths[start]), order[start:end]


def _takes(capacity_items: np.ndarray, k: int) -> np.ndarray:
    """How many of k items each bin takes, bins in order, each up to its capacity in items."""
    filled = np.cumsum(capacity_items)
    used = int(np.searchsorted(filled, k)) + 1  # bins needed; may exceed what exists
    takes = capacity_items[:used].copy()
    if used <= capacity_items.size:
        takes[-1] = k - (filled[used - 2] if used >= 2 else 0)
    return takes


def pack_first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index of every example under first-fit decreasing (ties: lower example index first).

    Items of one length are placed together: the first bin with room keeps taking them while it
    has room (it stays the first fit), which is exactly item-by-item FFD, without a Python loop
    per item.
    """
    n = lengths.size
    room = np.empty(n, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    n_bins = 0
    for length, items in _decreasing_groups(lengths):
        k = items.size
        placed = 0
        candidates = np.flatnonzero(room[:n_bins] >= length)
        if candidates.size:
            takes = _takes(room[candidates] // length, k)
            used = candidates[: takes.size]
            bin_of[items[: int(takes.sum())]] = np.repeat(used, takes)
            room[used] -= takes * length
            placed = int(takes.sum())
        n_bins += _open_bins(items[placed:], length, capacity, room, bin_of, n_bins)
    return bin_of


def _open_bins(
    items: np.ndarray,
    length: int,
    capacity: int,
    room: np.ndarray,
    bin_of: np.ndarray,
    n_bins: int,
) -> int:
    """Open new bins for items of one length that fit nowhere; each takes what it can.

    Returns how many bins were opened.
    """
    k = items.size
    if k == 0:
        return 0
    per_bin = capacity // length
    n_new = -(-k // per_bin)
    takes = np.full(n_new, per_bin, dtype=np.int64)
    takes[-1] = k - per_bin * (n_new - 1)
    new = np.arange(n_bins, n_bins + n_new, dtype=np.int64)
    bin_of[items] = np.repeat(new, takes)
    room[new] = capacity - takes * length
    return n_new


def pack_best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index of every example under best-fit decreasing.

    Best fit: the bin with the least room that still fits; among equal room, the bin that reached
    that room first (FIFO, as TRL's BFD). Items of one length are placed together: the best bin
    keeps taking them until it is full for that length (its shrinking room stays the best fit).
    """
    n = lengths.size
    room = np.empty(n, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    queues: dict[int, deque[np.ndarray]] = {}  # room -> FIFO of bin-id chunks
    occupied = np.zeros(capacity + 1, dtype=bool)
    n_bins = 0

    def push(level: int, bins: np.ndarray) -> None:
        if bins.size and level > 0:  # full bins can take nothing more: never queued
            queues.setdefault(level, deque()).append(bins)
            occupied[level] = True

    for length, items in _decreasing_groups(lengths):
        k = items.size
        placed = 0
        while placed < k:
            level = length + int(np.argmax(occupied[length:]))
            if not occupied[level]:
                break
            per_bin = level // length
            need = -(-(k - placed) // per_bin)
            bins = _pop_front(queues, occupied, level, need)
            takes = np.full(bins.size, per_bin, dtype=np.int64)
            if bins.size == need:
                takes[-1] = (k - placed) - per_bin * (need - 1)
            count = int(takes.sum())
            bin_of[items[placed : placed + count]] = np.repeat(bins, takes)
            room[bins] -= takes * length
            placed += count
            full_takers = bins[takes == per_bin]
            push(level - per_bin * length, full_takers)
            if full_takers.size < bins.size:  # the last bin, partly filled
                push(int(room[bins[-1]]), bins[-1:])
        if placed < k:
            opened = _open_bins(items[placed:], length, capacity, room, bin_of, n_bins)
            new = np.arange(n_bins, n_bins + opened, dtype=np.int64)
            n_bins += opened
            # All new bins but the last are equally full; the last may have taken fewer items.
            push(int(room[new[0]]), new[:-1])
            push(int(room[new[-1]]), new[-1:])
    return bin_of


def _pop_front(
    queues: dict[int, deque[np.ndarray]], occupied: np.ndarray, level: int, need: int
) -> np.ndarray:
    queue = queues[level]
    taken: list[np.ndarray] = []
    remaining = need
    while queue and remaining > 0:
        chunk = queue.popleft()
        if chunk.size > remaining:
            taken.append(chunk[:remaining])
            queue.appendleft(chunk[remaining:])
            remaining = 0
        else:
            taken.append(chunk)
            remaining -= chunk.size
    if not queue:
        occupied[level] = False
        del queues[level]
    return np.concatenate(taken)


PACKERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "ffd": pack_first_fit_decreasing,
    "bfd": pack_best_fit_decreasing,
}


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _normalised_entropy(sum_c_log_c: np.ndarray, sizes: np.ndarray, n_sources: int) -> np.ndarray:
    """H / log(min(size, n_sources)) per group; 0 where a group cannot hold two sources."""
    sizes_f = sizes.astype(np.float64)
    entropy = np.log(sizes_f) - sum_c_log_c / sizes_f
    ceiling = np.log(np.minimum(sizes_f, n_sources))
    out = np.zeros_like(entropy)
    ok = ceiling > 0
    out[ok] = np.clip(entropy[ok] / ceiling[ok], 0.0, 1.0)
    return out


def fixed_group_diversity(
    sources: np.ndarray, group_size: int, n_sources: int
) -> tuple[float, float]:
    """Mean distinct sources and mean normalised source entropy over consecutive groups.

    Groups are ``sources[0:g], sources[g:2g], ...``; the last may be shorter.
    """
    n = sources.size
    if n_sources <= 1 or group_size <= 1:
        return 1.0, 0.0
    n_full = n // group_size
    distinct_sum = 0.0
    entropy_sum = 0.0
    if n_full and group_size == 2:
        # Pairs: two sources or one; a mixed pair has entropy log 2, normalised 1.
        mixed = int(np.count_nonzero(sources[0 : 2 * n_full : 2] != sources[1 : 2 * n_full : 2]))
        distinct_sum, entropy_sum = float(n_full + mixed), float(mixed)
    elif n_full:
        rows = np.sort(sources[: n_full * group_size].reshape(n_full, group_size), axis=1)
        is_start = np.empty(rows.shape, dtype=bool)
        is_start[:, 0] = True
        np.not_equal(rows[:, 1:], rows[:, :-1], out=is_start[:, 1:])
        starts = np.flatnonzero(is_start.ravel())
        run_len = np.diff(np.append(starts, n_full * group_size))
        c_log_c = _C_LOG_C(group_size)[run_len]
        sum_c_log_c = float(c_log_c.sum())
        distinct_sum = float(starts.size)
        # Σ_rows H/ceiling with H = log g − Σ c log c / g, all rows of size g.
        ceiling = math.log(min(group_size, n_sources))
        entropy_sum = (n_full * math.log(group_size) - sum_c_log_c / group_size) / ceiling
    tail = sources[n_full * group_size :]
    n_groups = n_full
    if tail.size:
        counts = np.unique(tail, return_counts=True)[1].astype(np.float64)
        distinct_sum += counts.size
        entropy_sum += float(
            _normalised_entropy(
                np.array([(counts * np.log(counts)).sum()]), np.array([tail.size]), n_sources
            )[0]
        )
        n_groups += 1
    return distinct_sum / n_groups, entropy_sum / n_groups


def _C_LOG_C(size: int) -> np.ndarray:
    """Table of c·log c for c = 0..size (0·log 0 = 0)."""
    c = np.arange(size + 1, dtype=np.float64)
    return c * np.log(np.where(c > 0, c, 1.0))


def group_diversity(
    group_of: np.ndarray, sources: np.ndarray, n_groups: int, n_sources: int
) -> tuple[float, float]:
    """As fixed_group_diversity, for arbitrary (unsorted) group labels 0..n_groups-1."""
    if n_sources <= 1:
        return 1.0, 0.0
    keys = np.unique(group_of.astype(np.int64) * n_sources + sources, return_counts=True)
    pair_group = keys[0] // n_sources
    counts = keys[1].astype(np.float64)
    distinct = np.bincount(pair_group, minlength=n_groups)
    sizes = np.bincount(group_of, minlength=n_groups)
    c_log_c = np.bincount(pair_group, weights=counts * np.log(counts), minlength=n_groups)
    present = sizes > 0
    entropy = _normalised_entropy(c_log_c[present], sizes[present], n_sources)
    return float(distinct[present].mean()), float(entropy.mean())


def _quantile_of_ints(values: np.ndarray, q: float) -> int:
    """Inverted-CDF quantile of non-negative ints (an actual value, no interpolation)."""
    counts = np.bincount(values)
    cumulative = np.cumsum(counts)
    return int(np.searchsorted(cumulative, q * values.size))


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; 0.0 where either side is constant (nothing can follow anything)."""
    if x.size < 3:
        return 0.0
    x = x - x.mean()
    y = y - y.mean()
    # einsum, not `@`: a BLAS dot spins its thread pool and crawls on a busy machine.
    xx, yy, xy = (float(np.einsum("i,i->", a, b)) for a, b in ((x, x), (y, y), (x, y)))
    denominator = math.sqrt(xx * yy)
    return xy / denominator if denominator > 0 else 0.0


def _ranks_of_ints(values: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank) of non-negative ints, by counting."""
    counts = np.bincount(values)
    before = np.cumsum(counts) - counts
    return (before + (counts - 1) / 2.0)[values]


def order_follows_length(batch_lengths: np.ndarray) -> tuple[float, float]:
    """(Spearman of batch position vs length, lag-1 autocorrelation of batch length)."""
    positions = np.arange(batch_lengths.size, dtype=np.float64)
    spearman = _pearson(positions, _ranks_of_ints(batch_lengths))
    lag1 = _pearson(batch_lengths[:-1].astype(np.float64), batch_lengths[1:].astype(np.float64))
    return spearman, lag1


def _cv(values: np.ndarray) -> float:
    mean = float(values.mean()) if values.size else 0.0
    return float(values.std() / mean) if mean > 0 and values.size > 1 else 0.0


def padded_metrics(
    ordered_lengths: np.ndarray,
    ordered_sources: np.ndarray,
    micro_batch_size: int,
    grad_accum: int,
    n_sources: int,
    rows_per_micro_batch: np.ndarray | None = None,
) -> dict[str, float | int]:
    """Metrics of consecutive micro-batches of an ordering, each padded to its longest row.

    Micro-batches hold ``micro_batch_size`` rows (the last may hold fewer) unless
    ``rows_per_micro_batch`` gives each one's row count (a sampler with a variable micro-batch
    size, e.g. transformers' BatchRebalanceSampler); ``grad_accum`` micro-batches make a step.
    """
    n = ordered_lengths.size
    if rows_per_micro_batch is None:
        starts = np.arange(0, n, micro_batch_size)
        rows = np.diff(np.r_[starts, n])
    else:
        rows = np.asarray(rows_per_micro_batch, dtype=np.int64)
        if rows.sum() != n or (rows < 1).any():
            raise ValueError(
                f"rows_per_micro_batch sums to {int(rows.sum())} with minimum "
                f"{int(rows.min()) if rows.size else 0}; it must cover all {n} ordered examples "
                "with at least one row per micro-batch"
            )
        starts = np.r_[0, np.cumsum(rows)[:-1]].astype(np.int64)
    batch_len = np.maximum.reduceat(ordered_lengths, starts)
    batch_padded = rows * batch_len
    step_starts = np.arange(0, starts.size, grad_accum)
    step_padded = np.add.reduceat(batch_padded, step_starts)
    step_real = np.add.reduceat(ordered_lengths, starts[step_starts])
    spearman, lag1 = order_follows_length(batch_len)
    if rows_per_micro_batch is None:
        micro_distinct, micro_entropy = fixed_group_diversity(
            ordered_sources, micro_batch_size, n_sources
        )
        step_distinct, step_entropy = fixed_group_diversity(
            ordered_sources, micro_batch_size * grad_accum, n_sources
        )
    else:
        micro_of_row = np.repeat(np.arange(starts.size, dtype=np.int64), rows)
        step_of_row = micro_of_row // grad_accum
        micro_distinct, micro_entropy = group_diversity(
            micro_of_row, ordered_sources, starts.size, n_sources
        )
        step_distinct, step_entropy = group_diversity(
            step_of_row, ordered_sources, step_starts.size, n_sources
        )
    return {
        "n_micro_batches": int(starts.size),
        "n_steps": int(step_starts.size),
        "padded_tokens": int(batch_padded.sum()),
        "micro_batch_rows_max": int(rows.max()),
        "micro_batch_padded_tokens_max": int(batch_padded.max()),
        "attention_cost": int((rows * batch_len * batch_len).sum()),
        "batch_len_mean": float(batch_len.mean()),
        "batch_len_p50": _quantile_of_ints(batch_len, 0.5),
        "batch_len_p90": _quantile_of_ints(batch_len, 0.9),
        "batch_len_max": int(batch_len.max()),
        "order_length_spearman": spearman,
        "order_length_lag1_autocorr": lag1,
        "step_real_tokens_cv": _cv(step_real),
        "step_padded_tokens_cv": _cv(step_padded),
        "micro_distinct_sources": micro_distinct,
        "micro_source_entropy": micro_entropy,
        "step_distinct_sources": step_distinct,
        "step_source_entropy": step_entropy,
    }


def packed_metrics(
    lengths: np.ndarray,
    sources: np.ndarray,
    bin_of: np.ndarray,
    bin_order: np.ndarray,
    micro_batch_size: int,
    grad_accum: int,
    capacity: int,
    n_sources: int,
) -> dict[str, float | int]:
    """Metrics of packed bins taken in ``bin_order``, ``micro_batch_size`` bins per micro-batch.

    Every bin is a row of ``capacity`` tokens (static shape), documents kept apart by the mask.
    """
    n_bins = bin_order.size
    position = np.empty(n_bins, dtype=np.int64)
    position[bin_order] = np.arange(n_bins)
    micro_of_bin = position // micro_batch_size
    step_of_bin = micro_of_bin // grad_accum
    n_micro = -(-n_bins // micro_batch_size)
    n_steps = -(-n_micro // grad_accum)
    step_rows = np.bincount(step_of_bin, minlength=n_steps)
    step_real = np.bincount(step_of_bin[bin_of], weights=lengths, minlength=n_steps)
    micro_distinct, micro_entropy = group_diversity(
        micro_of_bin[bin_of], sources, n_micro, n_sources
    )
    step_distinct, step_entropy = group_diversity(step_of_bin[bin_of], sources, n_steps, n_sources)
    return {
        "n_micro_batches": int(n_micro),
        "n_steps": int(n_steps),
        "padded_tokens": int(n_bins * capacity),
        "micro_batch_rows_max": int(min(micro_batch_size, n_bins)),
        "micro_batch_padded_tokens_max": int(min(micro_batch_size, n_bins) * capacity),
        "attention_cost": int(n_bins * capacity * capacity),
        "batch_len_mean": float(capacity),
        "batch_len_p50": int(capacity),
        "batch_len_p90": int(capacity),
        "batch_len_max": int(capacity),
        "order_length_spearman": 0.0,
        "order_length_lag1_autocorr": 0.0,
        "step_real_tokens_cv": _cv(step_real),
        "step_padded_tokens_cv": _cv(step_rows.astype(np.float64)),
        "micro_distinct_sources": micro_distinct,
        "micro_source_entropy": micro_entropy,
        "step_distinct_sources": step_distinct,
        "step_source_entropy": step_entropy,
    }


# --------------------------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------------------------

RELATIVE_COLUMNS = (
    "micro_distinct_sources",
    "micro_source_entropy",
    "step_distinct_sources",
    "step_source_entropy",
)


def _strategy_name(m: int, m_all: int) -> str:
    if m == 1:
        return "random"
    return "global_sort" if m == m_all else "length_grouped"


def sweep_bucket_sizes(
    data: LengthSet,
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    seeds: Sequence[int],
    bucket_sizes: Iterable[int] | None = None,
    packing: Sequence[str] = PACKING_ALGORITHMS,
    order_fn: OrderFn = length_grouped_order,
    progress: bool = False,
    batch_rebalance: bool = True,
) -> pd.DataFrame:
    """One row per strategy × bucket size × seed (packing: per algorithm × seed).

    Every bucket size of one seed shares that seed's shuffle, as HF's sampler would (its shuffle
    does not depend on mega_batch_mult), so differences between sizes are not shuffle noise.
    ``batch_rebalance`` adds a comparison row per seed from transformers' own
    BatchRebalanceSampler (``probes.rebalance``; same shuffle as the seed's), where the installed
    transformers has it. It has no bucket size: the guard and the recommendation skip it.
    """
    from tqdm import tqdm

    from probes import rebalance

    lengths, sources = data.lengths, data.sources
    n = lengths.size
    sizes = sweep_bucket_sizes_for(n, micro_batch_size, grad_accum, bucket_sizes)
    m_all = all_bucket_size(n, micro_batch_size)
    m_hf = min(hf_trainer_mega_batch_mult(n, micro_batch_size, grad_accum), m_all)
    packings = {name: PACKERS[name](lengths, max_seq_len) for name in packing}
    real_tokens = int(lengths.sum())
    attention_useful = int((lengths * lengths).sum())
    rows: list[dict[str, Any]] = []
    with_rebalance = batch_rebalance and rebalance.unavailable_reason() is None
    bar = tqdm(
        total=len(seeds) * (len(sizes) + len(packings) + int(with_rebalance)),
        desc="bucket sweep",
        disable=not progress,
        file=None,
    )
    for seed in seeds:
        perm = seeded_permutation(n, seed)
        for m in sizes:
            order = order_fn(lengths, perm, micro_batch_size, m)
            metrics = padded_metrics(
                lengths[order], sources[order], micro_batch_size, grad_accum, data.n_sources
            )
            rows.append(
                {
                    "strategy": _strategy_name(m, m_all),
                    "bucket_size_batches": m,
                    "bucket_size_examples": min(m * micro_batch_size, n),
                    "is_hf_trainer_default": m == m_hf,
                    "seed": int(seed),
                    **metrics,
                }
            )
            bar.update()
        for name, bin_of in packings.items():
            n_bins = int(bin_of.max()) + 1
            bin_order = seeded_permutation(n_bins, seed)
            metrics = packed_metrics(
                lengths,
                sources,
                bin_of,
                bin_order,
                micro_batch_size,
                grad_accum,
                max_seq_len,
                data.n_sources,
            )
            rows.append(
                {
                    "strategy": f"packing_{name}",
                    "bucket_size_batches": None,
                    "bucket_size_examples": None,
                    "is_hf_trainer_default": False,
                    "seed": int(seed),
                    "n_bins": n_bins,
                    **metrics,
                }
            )
            bar.update()
        if with_rebalance:
            metrics = rebalance.rebalance_metrics(data, micro_batch_size, grad_accum, int(seed))
            metrics.pop("examples_fed")
            rows.append(
                {
                    "strategy": BATCH_REBALANCE,
                    "bucket_size_batches": None,
                    "bucket_size_examples": None,
                    "is_hf_trainer_default": False,
                    "seed": int(seed),
                    **metrics,
                }
            )
            bar.update()
    bar.close()
    frame = pd.DataFrame(rows)
    frame["bucket_size_batches"] = frame["bucket_size_batches"].astype("Int64")
    frame["bucket_size_examples"] = frame["bucket_size_examples"].astype("Int64")
    if "n_bins" not in frame:
        frame["n_bins"] = None
    frame["n_bins"] = frame["n_bins"].astype("Int64")
    frame.insert(5, "n_examples", n)
    frame.insert(6, "micro_batch_size", micro_batch_size)
    frame.insert(7, "grad_accum", grad_accum)
    frame["real_tokens"] = real_tokens
    frame["token_efficiency"] = real_tokens / frame["padded_tokens"]
    frame["attention_useful"] = attention_useful
    frame["attention_efficiency"] = attention_useful / frame["attention_cost"]
    return _add_relative_to_random(frame)


def _add_relative_to_random(frame: pd.DataFrame) -> pd.DataFrame:
    """Gains and diversity relative to random batching with the same seed (paired comparison)."""
    random = frame.loc[frame["strategy"] == "random"].set_index("seed")
    by_seed = frame["seed"]
    padded_random = by_seed.map(random["padded_tokens"])
    attention_random = by_seed.map(random["attention_cost"])
    frame["padded_tokens_saved_vs_random"] = 1.0 - frame["padded_tokens"] / padded_random
    frame["attention_cost_saved_vs_random"] = 1.0 - frame["attention_cost"] / attention_random
    frame["token_speedup_vs_random"] = padded_random / frame["padded_tokens"]
    frame["attention_speedup_vs_random"] = attention_random / frame["attention_cost"]
    for column in RELATIVE_COLUMNS:
        base = by_seed.map(random[column]).to_numpy(dtype=np.float64)
        value = frame[column].to_numpy(dtype=np.float64)
        # Nothing to lose when random batches already have no diversity (one source): 1.0.
        frame[f"{column}_rel_random"] = np.where(base > 0, value / np.where(base > 0, base, 1), 1.0)
    return frame


def strategy_rank(strategy: str) -> int:
    """Random first (the baseline), the sweep, global sort, then packing and anything else."""
    for rank, prefix in enumerate(STRATEGY_ORDER):
        if str(strategy).startswith(prefix):
            return rank
    return len(STRATEGY_ORDER)


def summarise(sweep: pd.DataFrame, diversity_level: str = "step") -> pd.DataFrame:
    """Mean over seeds per strategy × bucket size (packing rows: per algorithm, bucket size NA).

    Adds the spread over seeds of both efficiencies (std, ddof 0), the number of seeds, and
    `diversity_rel_random`: the lower of distinct sources and source entropy relative to random,
    per micro-batch (`diversity_level` "micro_batch") or per optimizer step ("step"), as the
    recommendation judges it. Rows in the report's order: contracts.STRATEGY_ORDER, then bucket
    size. This is `results/bucket/summary.parquet`.
    """
    keys = ["strategy", "bucket_size_batches"]
    numeric = sweep.drop(columns=["seed"]).select_dtypes(include="number").columns.difference(keys)
    table = sweep.assign(bucket_size_batches=sweep["bucket_size_batches"].fillna(-1))
    grouped = table.groupby(keys, sort=False)
    summary = grouped[list(numeric)].mean()
    spread = grouped[["token_efficiency", "attention_efficiency"]].std(ddof=0).fillna(0.0)
    summary["token_efficiency_std"] = spread["token_efficiency"]
    summary["attention_efficiency_std"] = spread["attention_efficiency"]
    summary["n_seeds"] = grouped["seed"].nunique()
    if "is_hf_trainer_default" in table:
        summary["is_hf_trainer_default"] = grouped["is_hf_trainer_default"].any()
    summary = summary.reset_index()
    prefix = "micro" if diversity_level == "micro_batch" else "step"
    diversity = [f"{prefix}_distinct_sources_rel_random", f"{prefix}_source_entropy_rel_random"]
    summary["diversity_rel_random"] = summary[diversity].min(axis=1, skipna=False)
    summary["bucket_size_batches"] = summary["bucket_size_batches"].astype("Int64")
    summary.loc[summary["bucket_size_batches"] < 0, "bucket_size_batches"] = pd.NA
    summary["_rank"] = summary["strategy"].map(strategy_rank)
    summary = summary.sort_values(["_rank", "bucket_size_batches", "strategy"], na_position="last")
    return summary.drop(columns="_rank").reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# Collapse guard
# --------------------------------------------------------------------------------------------


def reference_random_padded(lengths: np.ndarray, perm: np.ndarray, batch_size: int) -> int:
    """Padded tokens of HF's ordering with bucket size 1, computed without any sorting code.

    Micro-batches are the shuffle's consecutive chunks, except that HF swaps the longest example
    into batch 0 in exchange for batch 0's longest.
    """
    n = perm.size
    starts = np.arange(0, n, batch_size)
    chunk_len = lengths[perm]
    batch_len = np.maximum.reduceat(chunk_len, starts)
    best = int(np.argmax(batch_len))  # the first batch holding the global maximum
    if best != 0:
        first = chunk_len[:batch_size].copy()
        other = chunk_len[best * batch_size : (best + 1) * batch_size].copy()
        i_first, i_other = int(np.argmax(first)), int(np.argmax(other))
        first[i_first], other[i_other] = other[i_other], first[i_first]
        batch_len[0], batch_len[best] = first.max(), other.max()
    rows = np.diff(np.r_[starts, n])
    return int((rows * batch_len).sum())


def reference_sorted_padded(lengths: np.ndarray, batch_size: int) -> int:
    """Padded tokens of a global descending sort, computed without the ordering code."""
    ordered = np.sort(lengths)[::-1]
    starts = np.arange(0, ordered.size, batch_size)
    rows = np.diff(np.r_[starts, ordered.size])
    return int((rows * ordered[starts]).sum())


def assert_sweep_varies(
    sweep: pd.DataFrame, data: LengthSet, micro_batch_size: int
) -> dict[str, Any]:
    """Fail loudly if the sweep collapsed (every bucket size the same, or the ends are wrong).

    Checks, against references that share no code with the ordering:
    1. bucket size 1 reproduces random batching's padded tokens exactly, seed by seed;
    2. the largest bucket size reproduces the global sort's padded tokens exactly;
    3. where random and the global sort differ at all, the mean token efficiency differs across
       bucket sizes (the original bug made every size a global sort).
    Returns what was checked; raises SweepCollapsedError otherwise.
    """
    grouped = sweep.loc[sweep["bucket_size_batches"].notna()]
    lengths = data.lengths
    sorted_ref = reference_sorted_padded(lengths, micro_batch_size)
    m_max = int(grouped["bucket_size_batches"].max())
    m_all = all_bucket_size(lengths.size, micro_batch_size)
    problems: list[str] = []
    random_refs: dict[int, int] = {}
    for seed, rows in grouped.groupby("seed"):
        perm = seeded_permutation(lengths.size, int(seed))
        random_refs[int(seed)] = reference_random_padded(lengths, perm, micro_batch_size)
        at_1 = rows.loc[rows["bucket_size_batches"] == 1, "padded_tokens"]
        if at_1.empty or int(at_1.iloc[0]) != random_refs[int(seed)]:
            problems.append(
                f"seed {seed}: bucket size 1 gave {at_1.tolist()} padded tokens, random batching "
                f"gives {random_refs[int(seed)]}"
            )
        if m_max == m_all:
            at_all = int(rows.loc[rows["bucket_size_batches"] == m_all, "padded_tokens"].iloc[0])
            if at_all != sorted_ref:
                problems.append(
                    f"seed {seed}: bucket size {m_all} (all) gave {at_all} padded tokens, a "
                    f"global sort gives {sorted_ref}"
                )
    can_gain = any(ref != sorted_ref for ref in random_refs.values())
    efficiency = grouped.groupby("bucket_size_batches")["token_efficiency"].mean()
    spread = float(efficiency.max() - efficiency.min())
    if can_gain and (efficiency.size < 2 or spread <= 0.0):
        problems.append(
            f"token efficiency is {efficiency.iloc[0]:.6f} at every bucket size "
            f"{efficiency.index.tolist()} although random and sorted batching differ"
        )
    result = {
        "applicable": bool(can_gain),
        "reason": (
            "random and sorted batching differ; the sweep must vary"
            if can_gain
            else "random batching is already as good as a global sort: nothing to gain"
        ),
        "efficiency_spread": spread,
        "random_padded_reference": random_refs,
        "sorted_padded_reference": sorted_ref,
        "problems": problems,
    }
    if problems:
        raise SweepCollapsedError(
            "bucket sweep collapsed or wrong: " + "; ".join(problems) + ". The ordering must "
            "sort within each megabatch only (see the README's collapse rule)."
        )
    return result


# --------------------------------------------------------------------------------------------
# Recommendation
# --------------------------------------------------------------------------------------------


def recommend(
    sweep: pd.DataFrame,
    gain_share: float,
    min_diversity_share: float,
    gain_metric: str = "tokens",
    diversity_level: str = "step",
) -> dict[str, Any]:
    """The smallest bucket size reaching ``gain_share`` of the best gain with diversity kept.

    Gain = share of random batching's padded tokens (or dense attention cost) saved, mean over
    seeds. Diversity = the lower of distinct-sources and source-entropy relative to random, at
    the micro-batch or optimizer-step level. Smaller buckets keep batches closer to random.
    """
    summary = summarise(sweep, diversity_level)
    grouped = summary.loc[summary["bucket_size_batches"].notna()].sort_values("bucket_size_batches")
    gain_column = (
        "padded_tokens_saved_vs_random"
        if gain_metric == "tokens"
        else "attention_cost_saved_vs_random"
    )
    best = grouped.loc[grouped[gain_column].idxmax()]
    best_gain = float(best[gain_column])
    meets_gain = grouped[gain_column] >= gain_share * best_gain
    meets_diversity = grouped["diversity_rel_random"] >= min_diversity_share
    if best_gain <= 0:
        status = "nothing_to_gain"
        chosen = grouped.iloc[0]
    elif (meets_gain & meets_diversity).any():
        status = "ok"
        chosen = grouped.loc[meets_gain & meets_diversity].iloc[0]
    else:
        # No size reaches the gain while keeping diversity: the best gain diversity allows.
        status = "no_size_meets_both"
        allowed = grouped.loc[meets_diversity]
        chosen = allowed.loc[allowed[gain_column].idxmax()]
    random = grouped.iloc[0]
    hf = grouped.loc[grouped["is_hf_trainer_default"]]
    m = int(chosen["bucket_size_batches"])
    micro = int(sweep["micro_batch_size"].iloc[0])
    grad_accum = int(sweep["grad_accum"].iloc[0])
    n = int(sweep["n_examples"].iloc[0])
    recommended_rows = sweep.loc[sweep["bucket_size_batches"] == m]
    packed = sweep.loc[sweep["strategy"].str.startswith("packing_")]
    return {
        "status": status,
        "thresholds": {
            "gain_share": gain_share,
            "min_diversity_share": min_diversity_share,
            "gain_metric": gain_metric,
            "diversity_level": diversity_level,
        },
        "recommended": {
            **_point(chosen, gain_column),
            "bucket_size_examples": min(m * micro, n),
            "how_to_use": (
                f"probes.sampler.LengthGroupedSampler(lengths, micro_batch_size={micro}, "
                f"bucket_size_batches={m}, seed=...) (the ordering measured here; = "
                "transformers.trainer_pt_utils.get_length_grouped_indices(lengths, "
                f"batch_size={micro}, mega_batch_mult={m}))"
            ),
            "hf_trainer_equivalent": _trainer_equivalent(m, grad_accum),
        },
        "best_gain": {**_point(best, gain_column)},
        "random": _point(random, gain_column),
        "hf_trainer_default": _point(hf.iloc[0], gain_column) if not hf.empty else None,
        "packing": {
            row["strategy"]: {
                "token_efficiency": float(row["token_efficiency"]),
                "attention_efficiency": float(row["attention_efficiency"]),
                "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
                "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
                "n_bins": int(row["n_bins"]),
                "n_micro_batches": int(row["n_micro_batches"]),
                "micro_distinct_sources_rel_random": float(
                    row["micro_distinct_sources_rel_random"]
                ),
                "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
            }
            for _, row in summary.loc[summary["strategy"].str.startswith("packing_")].iterrows()
        },
        "batch_rebalance": _rebalance_point(summary),
        "attention_note": ATTENTION_NOTE,
        "batch_shapes": {
            "micro_batch_size": micro,
            "padded_length_p50": int(recommended_rows["batch_len_p50"].median()),
            "padded_length_p90": int(recommended_rows["batch_len_p90"].median()),
            "padded_length_max": int(recommended_rows["batch_len_max"].max()),
            "padded_length_mean": float(recommended_rows["batch_len_mean"].mean()),
            "packed_length": int(packed["batch_len_max"].iloc[0]) if not packed.empty else None,
            "note": "micro-batch shapes (rows × padded length) under the recommended bucket "
            "size, median over seeds of each quantile; for the profile stage's realistic shapes",
        },
    }


def _rebalance_point(summary: pd.DataFrame) -> dict[str, Any] | None:
    """Mean over seeds of the batch_rebalance comparison row, or None when it was not run."""
    rows = summary.loc[summary["strategy"] == BATCH_REBALANCE]
    if rows.empty:
        return None
    row = rows.iloc[0]
    return {
        "token_efficiency": float(row["token_efficiency"]),
        "attention_efficiency": float(row["attention_efficiency"]),
        "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
        "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
        "n_micro_batches": float(row["n_micro_batches"]),
        "micro_batch_rows_max": float(row["micro_batch_rows_max"]),
        "micro_batch_padded_tokens_max": float(row["micro_batch_padded_tokens_max"]),
        "diversity_rel_random": float(row["diversity_rel_random"]),
        "micro_distinct_sources_rel_random": float(row["micro_distinct_sources_rel_random"]),
        "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
        "order_length_spearman": float(row["order_length_spearman"]),
        "step_real_tokens_cv": float(row["step_real_tokens_cv"]),
    }


def _trainer_equivalent(m: int, grad_accum: int) -> str:
    setting = (
        'TrainingArguments(train_sampling_strategy="group_by_length") (transformers 5; '
        "group_by_length=True in 4.x)"
    )
    if m % grad_accum == 0:
        return (
            f"{setting} groups with batch = micro × grad_accum; this bucket is "
            f"mega_batch_mult={m // grad_accum} there (the Trainer fixes it at "
            f"min(n // (4 × batch), {HF_MAX_MEGA_BATCH_MULT}); other sizes need "
            "probes.sampler.LengthGroupedSampler)"
        )
    return (
        f"not expressible with {setting}: its megabatch is a multiple of micro × "
        f"grad_accum = {grad_accum} micro-batches; use probes.sampler.LengthGroupedSampler"
    )


def _point(row: pd.Series, gain_column: str) -> dict[str, Any]:
    return {
        "bucket_size_batches": int(row["bucket_size_batches"]),
        "token_efficiency": float(row["token_efficiency"]),
        "attention_efficiency": float(row["attention_efficiency"]),
        "gain": float(row[gain_column]),
        "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
        "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
        "token_speedup_vs_random": float(row["token_speedup_vs_random"]),
        "diversity_rel_random": float(row["diversity_rel_random"]),
        "micro_distinct_sources_rel_random": float(row["micro_distinct_sources_rel_random"]),
        "micro_source_entropy_rel_random": float(row["micro_source_entropy_rel_random"]),
        "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
        "step_source_entropy_rel_random": float(row["step_source_entropy_rel_random"]),
        "order_length_spearman": float(row["order_length_spearman"]),
        "step_real_tokens_cv": float(row["step_real_tokens_cv"]),
        "micro_batch_padded_tokens_max": float(row["micro_batch_padded_tokens_max"]),
    }


# --------------------------------------------------------------------------------------------
# Positive control
# --------------------------------------------------------------------------------------------

CONTROL_SEEDS = (0, 1, 2, 3, 4)


def _odd_share_hypergeometric(population: int, successes: int, draws: int) -> float:
    """P(an odd number of successes) when drawing without replacement (exact, big ints)."""
    total = math.comb(population, draws)
    odd = sum(
        math.comb(successes, x) * math.comb(population - successes, draws - x)
        for x in range(1, min(successes, draws) + 1, 2)
    )
    return odd / total


def two_length_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """Known answer: N/2 examples of 64 tokens (source a), N/2 of 1024 (source b), micro-batch 2.

    A megabatch of M = 2m examples sorted by length holds at most one mixed micro-batch, mixed
    exactly when it drew an odd number of long examples, so the expected number of mixed
    micro-batches is (N / M) · P(odd) (hypergeometric, exact); the global sort has none at all
    (token efficiency 1.0, one source per micro-batch). Tolerance: 4 binomial standard errors of
    the mean over seeds, plus 2 for HF's longest-first swap.
    """
    n, short, long_ = 4096, 64, 1024
    micro = 2
    lengths = np.repeat(np.array([short, long_], dtype=np.int64), n // 2)
    sources = np.repeat(np.array([0, 1], dtype=np.int32), n // 2)
    data = LengthSet(lengths, sources, ("a", "b"))
    sizes = [1, 2, 8, 32, 128, 512, n // micro]
    sweep = sweep_bucket_sizes(
        data,
        micro,
        1,
        long_,
        CONTROL_SEEDS,
        bucket_sizes=sizes,
        packing=(),
        order_fn=order_fn,
        batch_rebalance=False,
    )
    real = int(lengths.sum())
    checks = []
    for m in sizes:
        rows = sweep.loc[sweep["bucket_size_batches"] == m]
        mixed = float(((rows["padded_tokens"] - real) / (long_ - short)).mean())
        megabatches = n // (m * micro)
        p_odd = _odd_share_hypergeometric(n, n // 2, m * micro)
        expected = megabatches * p_odd
        tolerance = (
            4 * math.sqrt(megabatches * p_odd * (1 - p_odd) / len(CONTROL_SEEDS)) + 2
            if m < n // micro
            else 0.0
        )
        checks.append(
            {
                "bucket_size_batches": m,
                "expected_mixed_micro_batches": expected,
                "observed_mixed_micro_batches": mixed,
                "tolerance": tolerance,
                "passed": bool(abs(mixed - expected) <= tolerance),
            }
        )
    at_all = sweep.loc[sweep["bucket_size_batches"] == n // micro]
    global_sort_exact = bool(
        (at_all["token_efficiency"] == 1.0).all()
        and (at_all["micro_distinct_sources"] == 1.0).all()
    )
    return {
        "checks": checks,
        "global_sort_token_efficiency": float(at_all["token_efficiency"].mean()),
        "global_sort_distinct_sources_per_micro_batch": float(
            at_all["micro_distinct_sources"].mean()
        ),
        "passed": bool(all(c["passed"] for c in checks) and global_sort_exact),
        "sweep": sweep,
        "data": data,
    }


def hf_equivalence_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """Our ordering equals transformers' get_length_grouped_indices index for index."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    rng = np.random.default_rng(20260824)
    heavy = np.clip(rng.lognormal(5.0, 1.2, 1000), 1, 4096).astype(np.int64)  # ties included
    two = np.repeat(np.array([64, 1024], dtype=np.int64), 2048)
    cases = [(two, 2, m, 0) for m in (1, 8, 2048)]
    cases += [(heavy, 3, m, 1) for m in (1, 5, 50, 334)]
    results = []
    for lengths, batch, mult, seed in cases:
        ours = order_fn(lengths, seeded_permutation(lengths.size, seed), batch, mult)
        theirs = get_length_grouped_indices(
            lengths.tolist(),
            batch,
            mega_batch_mult=mult,
            generator=torch.Generator().manual_seed(seed),
        )
        results.append(
            {
                "n": int(lengths.size),
                "batch_size": batch,
                "mega_batch_mult": mult,
                "seed": seed,
                "identical": bool(ours.tolist() == list(theirs)),
            }
        )
    return {"cases": results, "passed": all(r["identical"] for r in results)}


def packing_control() -> dict[str, Any]:
    """Known answer: 100 × 768 + 10 × 512 + 100 × 256 tokens in 1024-token bins = 105 full bins."""
    capacity = 1024
    lengths = np.concatenate([np.full(100, 768), np.full(10, 512), np.full(100, 256)]).astype(
        np.int64
    )
    rng = np.random.default_rng(0)
    lengths = lengths[rng.permutation(lengths.size)]
    observed = {}
    for name, packer in PACKERS.items():
        bin_of = packer(lengths, capacity)
        fill = np.bincount(bin_of, weights=lengths)
        observed[name] = {
            "n_bins": int(bin_of.max()) + 1,
            "token_efficiency": float(lengths.sum() / ((bin_of.max() + 1) * capacity)),
            "overfull_bins": int((fill > capacity).sum()),
        }
    passed = all(
        o["n_bins"] == 105 and o["token_efficiency"] == 1.0 and o["overfull_bins"] == 0
        for o in observed.values()
    )
    return {
        "expected": {"n_bins": 105, "token_efficiency": 1.0},
        "observed": observed,
        "passed": passed,
    }


def run_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """The stage's positive control: known answers the instrument must recover first."""
    two = two_length_control(order_fn)
    hf = hf_equivalence_control(order_fn)
    packing = packing_control()
    guard_passes_real = True
    try:
        assert_sweep_varies(two["sweep"], two["data"], 2)
    except SweepCollapsedError:
        guard_passes_real = False
    collapsed = sweep_bucket_sizes(
        two["data"],
        2,
        1,
        1024,
        CONTROL_SEEDS[:2],
        bucket_sizes=[1, 8, 2048],
        packing=(),
        order_fn=global_sort_collapse,
        batch_rebalance=False,
    )
    try:
        assert_sweep_varies(collapsed, two["data"], 2)
        guard_fires_on_collapse = False
    except SweepCollapsedError:
        guard_fires_on_collapse = True
    passed = (
        two["passed"]
        and hf["passed"]
        and packing["passed"]
        and guard_passes_real
        and guard_fires_on_collapse
    )
    return {
        "name": "bucket_known_answers",
        "description": (
            "Synthetic two-length set (2048 × 64 and 2048 × 1024 tokens, two sources, "
            "micro-batch 2): mixed micro-batches per bucket size must match the exact "
            "hypergeometric expectation and the global sort must be padding-free and "
            "single-source; the ordering must equal transformers' get_length_grouped_indices "
            "index for index; FFD/BFD must pack a set with a known perfect packing into 105 full "
            "bins; the collapse guard must pass the real sweep and fire on a collapsing one."
        ),
        "expected": {
            "mixed_micro_batches": {
                c["bucket_size_batches"]: round(c["expected_mixed_micro_batches"], 3)
                for c in two["checks"]
            },
            "global_sort_token_efficiency": 1.0,
            "global_sort_distinct_sources_per_micro_batch": 1.0,
            "hf_identical_orderings": len(hf["cases"]),
            "packing": packing["expected"],
            "guard_passes_real_sweep": True,
            "guard_fires_on_collapsed_sweep": True,
        },
        "observed": {
            "mixed_micro_batches": {
                c["bucket_size_batches"]: round(c["observed_mixed_micro_batches"], 3)
                for c in two["checks"]
            },
            "mixed_micro_batches_tolerance": {
                c["bucket_size_batches"]: round(c["tolerance"], 3) for c in two["checks"]
            },
            "global_sort_token_efficiency": two["global_sort_token_efficiency"],
            "global_sort_distinct_sources_per_micro_batch": two[
                "global_sort_distinct_sources_per_micro_batch"
            ],
            "hf_identical_orderings": sum(r["identical"] for r in hf["cases"]),
            "hf_cases": hf["cases"],
            "packing": packing["observed"],
            "guard_passes_real_sweep": guard_passes_real,
            "guard_fires_on_collapsed_sweep": guard_fires_on_collapse,
        },
        "passed": bool(passed),
    }


# --------------------------------------------------------------------------------------------
# Synthetic input (tests, benchmark, trying the stage without the padding stage)
# --------------------------------------------------------------------------------------------


def synthetic_lengths(
    n: int, seed: int = 0, max_seq_len: int = 4096, n_sources: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed full lengths (lognormal, median ~150-400 tokens) and source codes.

    Sources differ in typical length, as real mixtures do, so length grouping costs diversity.
    Returns (full lengths before truncation, source codes).
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_sources + 1)  # Zipf-like source sizes
    sources = rng.choice(n_sources, size=n, p=weights / weights.sum()).astype(np.int32)
    mu = 5.0 + 1.0 * sources / max(n_sources - 1, 1)
    full = np.ceil(rng.lognormal(mu, 1.0)).astype(np.int64)
    return np.maximum(full, 1), sources


def synthetic_lengths_frame(
    n: int,
    seed: int = 0,
    max_seq_len: int = 4096,
    n_sources: int = 8,
    empty_share: float = 0.01,
    error_share: float = 0.005,
) -> pd.DataFrame:
    """A table with the padding stage's lengths schema (example_id ... n_truncated_tokens)."""
    full, sources = synthetic_lengths(n, seed, max_seq_len, n_sources)
    rng = np.random.default_rng(seed + 1)
    status = np.where(full > max_seq_len, "TRUNCATED", "OK").astype(object)
    draw = rng.random(n)
    status[draw < empty_share + error_share] = "ERROR"
    status[draw < empty_share] = "EMPTY"
    bad = np.isin(status, SKIPPED_STATUSES)
    full = np.where(bad, 0, full)
    kept = np.minimum(full, max_seq_len)
    return pd.DataFrame(
        {
            "example_id": [f"{seed:04x}{i:012x}" for i in range(n)],
            "file": "synthetic.jsonl",
            "row": np.arange(n, dtype=np.int64),
            "source": [f"source_{s}" for s in sources],
            "status": status.astype(str),
            "n_tokens": kept,
            "n_tokens_full": full,
            "n_loss_tokens": kept // 2,
            "n_turns": np.where(bad, 0, 2),
            "n_truncated_tokens": full - kept,
        }
    )
