"""Whole examples packed into ``max_seq_len`` rows by the library that implements the strategy.

``bfd`` (best-fit decreasing) is TRL's ``trl.data_utils.pack_dataset(dataset, seq_length,
strategy="bfd")``, the very call ``SFTTrainer`` makes on its prepared dataset under
``SFTConfig(packing=True)`` (``packing_strategy`` defaults to "bfd"; the trainer passes no ``map``
batch size, so datasets' default of 1,000 applies and TRL packs each run of 1,000 consecutive
examples on its own). It is called here on a lengths-only dataset: example ``i``'s ``input_ids`` is
``i`` repeated ``lengths[i]`` times, so every packed row names its examples, in TRL's row order and
TRL's document order, and the row lengths are TRL's by construction.

No hand-written packer remains. First-fit decreasing (``ffd``) was dropped: no installed library
implements it and no trainer the report names packs that way (``REMOVED_STRATEGIES``). TRL's other
strategies are not offered: on lengths already capped at ``max_seq_len`` ``bfd_split`` packs as
``bfd`` does, and ``wrapped`` cuts examples apart, so a row no longer holds whole examples.

The sweep shuffles the rows and takes ``micro_batch_size`` rows per micro-batch
(``metrics.packed_metrics``); the plans lay each micro-batch out as one flattened row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

BFD = "bfd"
PACKING_STRATEGIES = (BFD,)
# The library call behind each strategy (what the report and the control name).
LIBRARY_CALL = {BFD: 'trl.data_utils.pack_dataset(dataset, max_seq_len, strategy="bfd")'}
REMOVED_STRATEGIES = {
    "ffd": (
        "first-fit decreasing was the project's own packer: no installed library implements it "
        "and no trainer packs that way"
    ),
}


class PackingStrategyError(ValueError):
    """A packing strategy no installed library implements (the message says what to use)."""


def check_strategy(strategy: str) -> str:
    """``strategy`` if offered; otherwise a PackingStrategyError naming what to use instead."""
    if strategy in PACKING_STRATEGIES:
        return strategy
    why = REMOVED_STRATEGIES.get(strategy, "unknown packing strategy")
    raise PackingStrategyError(
        f"packing strategy {strategy!r} is not offered ({why}); use one of "
        f"{list(PACKING_STRATEGIES)} (TRL's pack_dataset, as SFTConfig(packing=True, "
        "packing_strategy=...) packs), or [] to skip packing"
    )


@dataclass(frozen=True)
class PackedRows:
    """The packed rows: row ``r`` holds examples ``documents[offsets[r]:offsets[r + 1]]``.

    Rows and the documents within a row are in the library's order; every example is in
    exactly one row.
    """

    documents: np.ndarray  # int64 example indices, row after row
    offsets: np.ndarray  # int64, n_rows + 1

    @property
    def n_rows(self) -> int:
        return int(self.offsets.size - 1)

    def row(self, index: int) -> np.ndarray:
        return self.documents[self.offsets[index] : self.offsets[index + 1]]

    def rows(self) -> list[np.ndarray]:
        return np.split(self.documents, self.offsets[1:-1])

    def bin_of(self) -> np.ndarray:
        """The row of every example (example index -> row index)."""
        row_of = np.empty(self.documents.size, dtype=np.int64)
        row_of[self.documents] = np.repeat(np.arange(self.n_rows), np.diff(self.offsets))
        return row_of


def lengths_dataset(lengths: np.ndarray):
    """A ``datasets.Dataset`` whose only column ``input_ids`` holds example ``i`` as ``i``
    repeated ``lengths[i]`` times: the lengths, and the ids that name each packed document."""
    import datasets
    import pyarrow as pa

    offsets = np.r_[0, np.cumsum(lengths, dtype=np.int64)]
    values = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
    if offsets[-1] > np.iinfo(np.int32).max:
        column = pa.LargeListArray.from_arrays(offsets, values)
    else:
        column = pa.ListArray.from_arrays(offsets.astype(np.int32), values)
    return datasets.Dataset(datasets.table.InMemoryTable(pa.table({"input_ids": column})))


def _check_lengths(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > max_seq_len):
        # TRL drops empty examples and truncates long ones: neither would stay one document.
        raise ValueError(
            f"lengths must lie in [1, max_seq_len={max_seq_len}]; got [{int(lengths.min())}, "
            f"{int(lengths.max())}] (cap them first, as the padding stage does)"
        )
    if lengths.size > np.iinfo(np.int32).max:
        raise ValueError(f"{lengths.size} examples: more than int32 ids can name")
    return lengths


def pack(lengths: np.ndarray, max_seq_len: int, strategy: str = BFD) -> PackedRows:
    """The rows the library packs ``lengths`` into (``strategy`` one of PACKING_STRATEGIES)."""
    check_strategy(strategy)
    lengths = _check_lengths(lengths, max_seq_len)
    if lengths.size == 0:
        return PackedRows(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    import datasets
    from trl.data_utils import pack_dataset

    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        packed = pack_dataset(lengths_dataset(lengths), max_seq_len, strategy=strategy)
    finally:
        if progress_was_on:
            datasets.enable_progress_bars()
    return _rows_of(packed.data.table)


def _rows_of(table) -> PackedRows:
    """Example ids and row offsets from a packed table (``input_ids``, ``seq_lengths``)."""
    documents, counts = [], []
    for batch in table.to_batches():
        ids, seq_lengths = batch.column("input_ids"), batch.column("seq_lengths")
        doc_lengths = seq_lengths.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.r_[0, np.cumsum(doc_lengths)[:-1]].astype(np.int64)
        tokens = ids.flatten().to_numpy(zero_copy_only=False)
        documents.append(tokens[starts].astype(np.int64) if doc_lengths.size else starts)
        counts.append(np.diff(seq_lengths.offsets.to_numpy()).astype(np.int64))
    documents_all = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int64)
    offsets = np.r_[0, np.cumsum(np.concatenate(counts) if counts else [])].astype(np.int64)
    return PackedRows(documents_all, offsets)


def pack_all(
    lengths: np.ndarray,
    max_seq_len: int,
    strategies: Iterable[str] = PACKING_STRATEGIES,
    packed: Mapping[str, PackedRows] | None = None,
) -> dict[str, PackedRows]:
    """Every requested strategy's rows: from ``packed`` where the caller packed them already (the
    bucket stage packs once for the sweep, the data-parallel sweep and the plans), else now."""
    rows = {}
    for name in strategies:
        if packed is not None and name in packed:
            rows[name] = packed[name]
        else:
            rows[name] = pack(lengths, max_seq_len, name)
    return rows


def packed_batch_shape(
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    n_examples: int,
    real_tokens: int,
    longest: int,
    n_rows: int,
) -> tuple[int, int]:
    """(packed rows per micro-batch, grad_accum) that the packing change pastes, keeping real
    tokens per update nearest the baseline's: the one home of this rule, for the plan the replay
    times and the settings recommendations.json emits (probes.apply.packing).

    The micro-batch holds at most what the baseline's first micro-batch held (micro × longest
    padded tokens, which already fits: HF puts the longest example first), at least one row;
    grad_accum then brings the step's real tokens nearest the baseline's."""
    if n_rows < 1:
        raise ValueError(f"n_rows must be ≥ 1, got {n_rows}")
    fill = real_tokens / n_rows  # real tokens per packed row
    target_rows = micro_batch_size * grad_accum * (real_tokens / n_examples) / fill
    rows = max(1, (micro_batch_size * longest) // max_seq_len)
    if rows > target_rows:
        rows = max(1, round(target_rows))
    return int(rows), int(max(1, round(target_rows / rows)))
