"""Whole examples packed into ``max_seq_len`` bins: first-fit and best-fit decreasing.

The sweep shuffles the bins and takes ``micro_batch_size`` bins per micro-batch
(``batch_metrics.packed_metrics``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

PACKING_ALGORITHMS = ("ffd", "bfd")


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
