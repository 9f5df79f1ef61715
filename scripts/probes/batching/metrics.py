"""Metrics of a batching: padded tokens, dense attention cost, source diversity, order statistics.

Definitions (the same for every strategy, so the bucket sweep's rows compare):

- token efficiency = real tokens / tokens the model computes over (micro-batch rows × padded length;
  a packed bin counts ``max_seq_len``);
- attention efficiency = Σ L² / Σ rows × S², i.e. the useful share of what a dense attention
  kernel (SDPA/eager with a padding or block-diagonal mask) computes, S being the padded row
  length. A varlen kernel (flash-attn with cu_seqlens, padding-free) spends only Σ L² on either,
  so this column is the dense-kernel view;
- source diversity per batch: distinct sources and normalised entropy H / log(min(size, #sources));
- order-follows-length: Spearman correlation of micro-batch position with its padded length (the
  epoch-long trend), and lag-1 autocorrelation of padded length (neighbouring batches alike).
"""

from __future__ import annotations

import math

import numpy as np


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


def padded_micro_batches(
    ordered_lengths: np.ndarray,
    micro_batch_size: int,
    rows_per_micro_batch: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first row, rows, padded length) of each micro-batch of an ordering.

    Micro-batches are consecutive: ``micro_batch_size`` rows each, the last may hold fewer
    (drop_last=False), unless ``rows_per_micro_batch`` gives each one's row count. Each is padded
    to its longest row.
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
    return starts, rows, np.maximum.reduceat(ordered_lengths, starts)


def batch_slots(ordered_lengths: np.ndarray, batch_size: int, power: int = 1) -> int:
    """Padded slots when consecutive groups of `batch_size` are padded to their longest:
    sum over batches of rows * max_len**power (power=2: attention slots)."""
    lengths = np.asarray(ordered_lengths, dtype=np.int64)
    _, rows, batch_len = padded_micro_batches(lengths, batch_size)
    return int(np.sum(rows * batch_len**power))


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
    starts, rows, batch_len = padded_micro_batches(
        ordered_lengths, micro_batch_size, rows_per_micro_batch
    )
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
