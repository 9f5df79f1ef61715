"""Band structure of attention masks, measured row by row, vectorised.

A mask row q lists the keys query q may attend. For every causal pattern transformers builds
(causal, sliding window, padding, packed documents) each row's allowed keys form one contiguous
interval [first, last]; the gate checks that, and that the interval is exactly the one the
configuration asks for. Everything here is pure tensor/array code on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

ROW_CHUNK = 1024  # rows per step: bounds temporaries (a float mask's bool copy) to chunk x kv_len


@dataclass
class RowIntervals:
    """Per (sequence, query row): first and last allowed key and how many keys are allowed."""

    first: np.ndarray  # (B, Tq) int64; 0 when the row allows nothing
    last: np.ndarray  # (B, Tq) int64; -1 when the row allows nothing
    count: np.ndarray  # (B, Tq) int64
    pad_keys_attended: np.ndarray  # (B, Tq) int64: allowed keys that are padding

    @property
    def contiguous(self) -> np.ndarray:
        return (self.count == 0) | (self.count == self.last - self.first + 1)


@dataclass
class BandSummary:
    """One row of layers.parquet's band columns, over the rows that matter (non-padding queries)."""

    band_lower: int | None  # max over rows of q - first: how far back the band reaches
    band_upper: int | None  # max over rows of last - q: > 0 means some query sees the future
    keys_min: int | None
    keys_max: int | None
    blocks: int  # diagonal blocks: rows whose first allowed key is the row itself
    fully_masked_rows: int  # rows (any, padding included) that may attend nothing
    pad_keys_attended: int  # (real query, padding key) pairs allowed: must be 0
    noncontiguous_rows: int
    rows_checked: int
    mismatched_rows: int  # rows whose interval differs from the expected one
    first_mismatch: str | None


def allowed_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' from a boolean mask or an additive float mask (0 = attend)."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def _collapse_heads(mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() == 2:
        return mask[None]
    if mask.dim() != 4:
        raise ValueError(f"expected a 2-D or 4-D attention mask, got shape {tuple(mask.shape)}")
    if mask.shape[1] != 1:
        # head-specific masks: every head must agree for the band to be a property of the layer
        if not bool((mask == mask[:, :1]).all()):
            raise ValueError(
                "attention mask differs across heads; per-head bands are not supported"
            )
    return mask[:, 0]


def row_intervals(mask: torch.Tensor, key_is_pad: torch.Tensor | None = None) -> RowIntervals:
    """First/last/count of allowed keys for every query row of a (B, 1, Tq, Tk) mask.

    Rows are read in blocks of ROW_CHUNK, each once per statistic, without copies for a
    contiguous boolean mask (see :func:`block_intervals`). A batch dimension broadcast with
    stride 0 (the same mask for every sequence) is measured once.
    """
    mask3 = _collapse_heads(mask)
    batch, q_len = mask3.shape[0], mask3.shape[1]
    return intervals_by_rows(lambda start, stop: mask3[:, start:stop, :], batch, q_len, key_is_pad)


def intervals_by_rows(
    read_rows: Callable[[int, int], torch.Tensor],
    batch: int,
    q_len: int,
    key_is_pad: torch.Tensor | None = None,
    row_chunk: int = ROW_CHUNK,
) -> RowIntervals:
    """:func:`row_intervals` of a mask read `row_chunk` query rows at a time: `read_rows(start,
    stop)` gives rows [start, stop) as (B, rows, Tk) or (B, 1, rows, Tk), so the whole mask
    never needs to exist at once (probes.mask.shapes builds an SDPA mask that way)."""
    first = np.empty((batch, q_len), dtype=np.int64)
    last = np.empty((batch, q_len), dtype=np.int64)
    count = np.empty((batch, q_len), dtype=np.int64)
    for start in range(0, q_len, row_chunk):
        stop = min(start + row_chunk, q_len)
        block = read_rows(start, stop)
        if block.dim() == 4:
            block = _collapse_heads(block)
        if batch > 1 and block.shape[0] == batch and block.stride(0) == 0:
            block = block[:1]  # the same rows for every sequence: measured once
        stats = block_intervals(allowed_from_mask(block).numpy())
        for out, value in zip((first, last, count), stats, strict=True):
            out[:, start:stop] = value  # broadcasts a shared block over the batch
    return RowIntervals(first, last, count, pad_keys_in_interval(first, last, key_is_pad))


def block_intervals(allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, last, count) over the last axis of a boolean array; first 0 and last -1 on rows
    that allow nothing.

    The keys are read eight at a time: the row's bytes are viewed as 64-bit words (a bool is
    one byte, 0 or 1). The first and last allowed keys are the first and last non-zero byte of
    the first and last non-zero word; `count` sums the words in groups small enough that no byte
    lane carries. Arrays that cannot be viewed that way (key length not a multiple of 8, keys
    not adjacent in memory) take the plain per-key reductions.
    """
    k_len = allowed.shape[-1]
    if k_len % 8 == 0 and k_len > 0 and allowed.strides[-1] == 1:
        words = allowed.view(np.uint64)
        count = _count_by_words(words)
        nonzero_words = words != 0
        n_words = words.shape[-1]
        first_word = nonzero_words.argmax(-1)
        last_word = n_words - 1 - np.ascontiguousarray(nonzero_words[..., ::-1]).argmax(-1)
        first = 8 * first_word + _lane_of(words, first_word, last=False)
        last = 8 * last_word + _lane_of(words, last_word, last=True)
    else:
        first = allowed.argmax(-1).astype(np.int64)
        count = np.count_nonzero(allowed, axis=-1).astype(np.int64)
        last = k_len - 1 - np.ascontiguousarray(allowed[..., ::-1]).argmax(-1).astype(np.int64)
    empty = count == 0
    first[empty], last[empty] = 0, -1
    return first, last, count


def _lane_of(words: np.ndarray, index: np.ndarray, last: bool) -> np.ndarray:
    """Position (0..7) of the first or last non-zero byte of words[..., index], in memory order."""
    word = np.take_along_axis(words, index[..., None], axis=-1)
    lanes = word.view(np.uint8).reshape(*word.shape[:-1], 8)
    if last:
        return (7 - lanes[..., ::-1].argmax(-1)).astype(np.int64)
    return lanes.argmax(-1).astype(np.int64)


def _count_by_words(words: np.ndarray) -> np.ndarray:
    """Allowed keys per row from the 64-bit word view of a 0/1 byte array."""
    n_words = words.shape[-1]
    # the largest group of words whose per-lane sum cannot exceed 255 and that divides the row
    group = next(g for g in range(min(255, n_words), 0, -1) if n_words % g == 0)
    grouped = words.reshape(*words.shape[:-1], n_words // group, group)
    lane_sums = grouped.sum(-1, dtype=np.uint64)  # each byte lane <= group <= 255: no carry
    return lane_sums.view(np.uint8).sum(-1, dtype=np.int64)


def pad_keys_in_interval(
    first: np.ndarray, last: np.ndarray, key_is_pad: torch.Tensor | np.ndarray | None
) -> np.ndarray:
    """How many padding keys lie in each row's [first, last] (exact for contiguous rows; a
    non-contiguous row is a violation on its own)."""
    if key_is_pad is None:
        return np.zeros_like(first)
    pads = np.asarray(key_is_pad, dtype=np.int64)
    if not pads.any():
        return np.zeros_like(first)
    prefix = np.concatenate([np.zeros((pads.shape[0], 1), np.int64), np.cumsum(pads, axis=1)], 1)
    rows = np.arange(first.shape[0])[:, None]
    hits = prefix[rows, last + 1] - prefix[rows, first]
    return np.where(last >= first, hits, 0)


def implied_intervals(batch: int, q_len: int, k_len: int, is_causal: bool) -> RowIntervals:
    """What SDPA attends with no mask: causal rows [0, q] (top-left aligned) or every key."""
    rows = np.arange(q_len, dtype=np.int64)
    first = np.zeros((batch, q_len), dtype=np.int64)
    if is_causal:
        last = np.broadcast_to(np.minimum(rows, k_len - 1), (batch, q_len)).copy()
    else:
        last = np.full((batch, q_len), k_len - 1, dtype=np.int64)
    count = last - first + 1
    return RowIntervals(first, last, count, np.zeros((batch, q_len), dtype=np.int64))


def document_starts(doc_ids: np.ndarray) -> np.ndarray:
    """(B, T) index of the first token of the document each position belongs to."""
    batch, length = doc_ids.shape
    change = np.ones((batch, length), dtype=bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    index = np.where(change, np.arange(length)[None, :], 0)
    return np.maximum.accumulate(index, axis=1)


def expected_intervals(doc_ids: np.ndarray, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The interval [lo, hi] each real query row must attend: its own document, causally,
    within the last `window` keys (itself included) when the layer slides.

    `doc_ids` is (B, T) with -1 on padding positions; padding rows are not checked.
    """
    starts = document_starts(doc_ids)
    rows = np.arange(doc_ids.shape[1], dtype=np.int64)[None, :]
    lo = starts.astype(np.int64)
    if window is not None:
        lo = np.maximum(lo, rows - window + 1)
    hi = np.broadcast_to(rows, doc_ids.shape).astype(np.int64)
    return lo, hi


def summarise(
    intervals: RowIntervals, doc_ids: np.ndarray, window: int | None, check: bool = True
) -> BandSummary:
    """Band columns over real (non-padding) query rows, and the comparison with the expectation."""
    real = doc_ids >= 0
    rows = np.arange(doc_ids.shape[1], dtype=np.int64)[None, :]
    nonempty = real & (intervals.count > 0)
    lower = np.where(nonempty, rows - intervals.first, np.iinfo(np.int64).min)
    upper = np.where(nonempty, intervals.last - rows, np.iinfo(np.int64).min)
    counts_real = intervals.count[real]
    has_rows = bool(nonempty.any())
    blocks = int((nonempty & (intervals.first == rows)).sum())
    noncontiguous = int((real & ~intervals.contiguous).sum())
    mismatched, first_mismatch = 0, None
    if check:
        lo, hi = expected_intervals(doc_ids, window)
        bad = real & (
            (intervals.first != lo)
            | (intervals.last != hi)
            | (intervals.count != hi - lo + 1)
            | (intervals.pad_keys_attended != 0)
        )
        mismatched = int(bad.sum())
        if mismatched:
            b, q = (int(x[0]) for x in np.nonzero(bad))
            observed = (
                f"keys [{intervals.first[b, q]}..{intervals.last[b, q]}] "
                f"({intervals.count[b, q]} allowed)"
            )
            first_mismatch = (
                f"sequence {b} row {q} attends {observed}; expected [{lo[b, q]}..{hi[b, q]}]"
            )
    return BandSummary(
        band_lower=int(lower.max()) if has_rows else None,
        band_upper=int(upper.max()) if has_rows else None,
        keys_min=int(counts_real.min()) if counts_real.size else None,
        keys_max=int(counts_real.max()) if counts_real.size else None,
        blocks=blocks,
        fully_masked_rows=int((intervals.count == 0).sum()),
        pad_keys_attended=int(intervals.pad_keys_attended[real].sum()),
        noncontiguous_rows=noncontiguous,
        rows_checked=int(real.sum()),
        mismatched_rows=mismatched,
        first_mismatch=first_mismatch,
    )
