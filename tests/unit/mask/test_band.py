"""Band measurement on hand-made masks (pure tensor code, no model)."""

import numpy as np
import torch

from probes.mask import band as mask_band


def causal(length: int, window: int | None = None) -> torch.Tensor:
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed[None, None]


def test_sliding_band_measures_window():
    intervals = mask_band.row_intervals(causal(20, window=5))
    summary = mask_band.summarise(intervals, np.zeros((1, 20), dtype=np.int64), window=5)
    assert (summary.band_lower, summary.band_upper) == (4, 0)
    assert (summary.keys_min, summary.keys_max) == (1, 5)
    assert summary.mismatched_rows == 0 and summary.noncontiguous_rows == 0


def test_wrong_window_is_a_mismatch_naming_the_row():
    intervals = mask_band.row_intervals(causal(20, window=5))
    summary = mask_band.summarise(intervals, np.zeros((1, 20), dtype=np.int64), window=6)
    assert summary.mismatched_rows == 15  # rows 5..19 differ; rows 0..4 are causal either way
    assert "row 5 attends keys [1..5]" in summary.first_mismatch
    assert "expected [0..5]" in summary.first_mismatch


def test_noncontiguous_row_is_detected():
    mask = causal(8)
    mask[0, 0, 6, 3] = False  # a hole inside row 6
    intervals = mask_band.row_intervals(mask)
    assert not intervals.contiguous[0, 6]
    summary = mask_band.summarise(intervals, np.zeros((1, 8), dtype=np.int64), window=None)
    assert summary.noncontiguous_rows == 1 and summary.mismatched_rows == 1


def test_float_additive_mask_and_shared_batch():
    allowed = causal(6, window=3).expand(3, 1, 6, 6)  # stride-0 batch: measured once
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    for mask in (allowed, additive):
        intervals = mask_band.row_intervals(mask)
        assert intervals.first.shape == (3, 6)
        assert intervals.count[:, 5].tolist() == [3, 3, 3]


def test_pad_keys_counted_from_intervals():
    mask = causal(6).clone().expand(2, 1, 6, 6).clone()
    key_is_pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    intervals = mask_band.row_intervals(mask, key_is_pad)  # row 5 of sequence 1 sees 2 pads
    assert intervals.pad_keys_attended[1, 5] == 2 and intervals.pad_keys_attended[0, 5] == 0
    ids = np.where(key_is_pad.numpy(), -1, 0)
    summary = mask_band.summarise(intervals, ids, window=None)
    assert summary.pad_keys_attended == 0  # padding query rows are not counted


def test_expected_intervals_packed_and_windowed():
    doc_ids = np.array([[0, 0, 0, 0, 1, 1, 1, -1]])
    lo, hi = mask_band.expected_intervals(doc_ids, window=2)
    assert lo[0, :7].tolist() == [0, 0, 1, 2, 4, 4, 5]
    assert hi[0, :7].tolist() == list(range(7))


def test_implied_intervals_for_is_causal():
    intervals = mask_band.implied_intervals(2, 5, 5, is_causal=True)
    assert intervals.last[1].tolist() == [0, 1, 2, 3, 4]
    summary = mask_band.summarise(intervals, np.zeros((2, 5), dtype=np.int64), window=None)
    assert summary.band_lower == 4 and summary.blocks == 2
