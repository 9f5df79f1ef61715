"""Packing is TRL's own: the rows equal ``trl.data_utils.pack_dataset``'s row for row.

Each reference packs a dataset of real-looking token ids (random values, the given lengths) with
TRL directly, as SFTTrainer does; our rows (packed through the lengths-only dataset) must name
documents whose tokens, concatenated in our order, are TRL's row, for every row in TRL's order.
"""

from pathlib import Path

import numpy as np
import pytest

from probes.batching import packing
from probes.bucket import control as bucket_controls
from probes.config import ConfigError, check_removed_options

DEFAULT_LENGTHS = Path(__file__).parents[2] / "fixtures" / "default_lengths.txt"


def _trl_rows(lengths: np.ndarray, max_seq_len: int, seed: int = 0):
    """Random token ids with these lengths (flat, offsets) and TRL's packed table of them."""
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    tokens = np.random.default_rng(seed).integers(0, 50_000, int(lengths.sum()), dtype=np.int64)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    dataset = datasets.Dataset.from_dict(
        {"input_ids": pa.ListArray.from_arrays(offsets, pa.array(tokens))}
    )
    datasets.disable_progress_bars()
    packed = pack_dataset(dataset, max_seq_len, strategy="bfd").with_format("arrow")[:]
    return tokens, offsets, packed


def assert_rows_equal_trl(lengths: np.ndarray, max_seq_len: int) -> packing.PackedRows:
    """Row for row: same number of rows, each row's documents and tokens in TRL's order."""
    ours = packing.pack(lengths, max_seq_len, "bfd")
    tokens, offsets, theirs = _trl_rows(lengths, max_seq_len)
    row_ids = theirs["input_ids"].combine_chunks()
    row_docs = theirs["seq_lengths"].combine_chunks()
    assert ours.n_rows == len(row_ids)
    # documents per row, and each document's length, in TRL's order
    assert np.array_equal(np.diff(ours.offsets), np.diff(row_docs.offsets.to_numpy()))
    assert np.array_equal(lengths[ours.documents], row_docs.flatten().to_numpy())
    # every row's tokens: our documents' tokens, concatenated in our order
    ours_tokens = np.concatenate([tokens[offsets[d] : offsets[d + 1]] for d in ours.documents])
    assert np.array_equal(ours_tokens, row_ids.flatten().to_numpy())
    assert np.array_equal(np.sort(ours.documents), np.arange(lengths.size))
    return ours


def _mix(parts: list[np.ndarray], seed: int) -> np.ndarray:
    lengths = np.concatenate(parts).astype(np.int64)
    return lengths[np.random.default_rng(seed).permutation(lengths.size)]


def test_docstring_example_of_trl():
    rows = assert_rows_equal_trl(np.array([5, 2, 3, 1]), 5)
    assert [r.tolist() for r in rows.rows()] == [[0], [2, 1], [3]]


def test_default_data_rows_equal_trl():
    lengths = np.loadtxt(DEFAULT_LENGTHS, dtype=np.int64, comments="#")
    assert lengths.size == 7168
    rows = assert_rows_equal_trl(lengths, 4096)
    fill = np.bincount(rows.bin_of(), weights=lengths)
    # TRL's figures on the default data (issue 31): 827 rows, 529 of them full.
    assert (rows.n_rows, int((fill == 4096).sum())) == (827, 529)


MIXES = {
    # heavy-tailed chat: several sources of different typical length, cut at max_seq_len
    "heavy_tailed_sources": lambda rng, cap: np.minimum(
        bucket_controls.synthetic_lengths(2500, seed=3)[0], cap
    ),
    # short chat turns with a tail of documents at the cap (ties at the cap and at 1)
    "chat_and_capped_docs": lambda rng, cap: _mix(
        [rng.integers(1, 40, 1400), np.full(300, cap), np.ones(50, dtype=np.int64)], 1
    ),
    # few distinct lengths: long runs of equal items, some that fill a row exactly
    "few_lengths": lambda rng, cap: _mix(
        [np.full(700, cap // 2), np.full(500, cap // 4), np.full(640, cap // 3 + 1)], 2
    ),
    # uniform over the whole range, not a multiple of TRL's 1,000-example map batch
    "uniform": lambda rng, cap: rng.integers(1, cap + 1, 2345),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixes_rows_equal_trl(mix):
    cap = 512
    lengths = np.asarray(MIXES[mix](np.random.default_rng(7), cap), dtype=np.int64)
    assert_rows_equal_trl(lengths, cap)


def test_every_example_in_one_row_within_capacity():
    lengths = np.random.default_rng(0).integers(1, 300, 1500)
    rows = packing.pack(lengths, 300)
    assert np.bincount(rows.bin_of(), weights=lengths).max() <= 300
    assert rows.offsets[0] == 0 and rows.offsets[-1] == lengths.size
    assert (np.diff(rows.offsets) >= 1).all()


def test_empty_and_out_of_range_lengths():
    assert packing.pack(np.zeros(0, dtype=np.int64), 16).n_rows == 0
    with pytest.raises(ValueError, match="max_seq_len=16"):
        packing.pack(np.array([3, 17]), 16)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        packing.pack(np.array([3, 0]), 16)


def test_ffd_is_no_longer_offered_and_says_why():
    with pytest.raises(packing.PackingStrategyError, match="first-fit decreasing.*'bfd'"):
        packing.pack(np.array([3]), 16, "ffd")
    with pytest.raises(ConfigError, match=r"bucket\.packing\.0: packing strategy 'ffd'"):
        check_removed_options({"bucket": {"packing": ["ffd", "bfd"]}})
    check_removed_options({"bucket": {"packing": ["bfd"]}})
    check_removed_options({"bucket": {}})


def test_pack_all_reuses_rows_packed_already():
    lengths = np.array([5, 2, 3, 1])
    rows = packing.pack(lengths, 5)
    assert packing.pack_all(lengths, 5, ["bfd"], {"bfd": rows})["bfd"] is rows
    assert packing.pack_all(lengths, 5, []) == {}
