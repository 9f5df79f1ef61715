"""The word-wise band extraction against a brute-force reading of every row (np.flatnonzero)."""

import numpy as np
import pytest
import torch

from conftest import TINY_GEMMA3_CONFIG
from probes.mask import band as mask_band
from probes.mask.scenarios import packed_doc_ids, padded_doc_ids


def brute_force(mask: torch.Tensor, key_is_pad: torch.Tensor | None = None) -> dict:
    """First/last/count/pad keys per row, one row at a time, from the key indices themselves."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[:, 0].numpy()
    pads = None if key_is_pad is None else key_is_pad.numpy()
    out = {name: np.zeros(allowed.shape[:2], dtype=np.int64) for name in ("first", "last", "count")}
    out["pad"] = np.zeros(allowed.shape[:2], dtype=np.int64)
    for b in range(allowed.shape[0]):
        for q in range(allowed.shape[1]):
            keys = np.flatnonzero(allowed[b, q])
            if keys.size == 0:
                out["first"][b, q], out["last"][b, q] = 0, -1
                continue
            out["first"][b, q], out["last"][b, q], out["count"][b, q] = keys[0], keys[-1], keys.size
            if pads is not None:  # padding keys inside [first, last], as the gate counts them
                out["pad"][b, q] = int(pads[b, keys[0] : keys[-1] + 1].sum())
    return out


def assert_same(mask: torch.Tensor, key_is_pad: torch.Tensor | None = None) -> None:
    fast = mask_band.row_intervals(mask, key_is_pad)
    slow = brute_force(mask, key_is_pad)
    np.testing.assert_array_equal(fast.first, slow["first"])
    np.testing.assert_array_equal(fast.last, slow["last"])
    np.testing.assert_array_equal(fast.count, slow["count"])
    np.testing.assert_array_equal(fast.pad_keys_attended, slow["pad"])


def structured(doc_ids: np.ndarray, window: int | None) -> torch.Tensor:
    """The mask a model should build for these documents, from index arithmetic alone."""
    length = doc_ids.shape[1]
    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    allowed = (k <= q) & same_doc & (doc_ids[:, None, :] >= 0)
    if window is not None:
        allowed &= k > q - window
    return torch.from_numpy(allowed)[:, None]


@pytest.mark.parametrize("k_len", [1, 7, 8, 13, 64, 200, 2048 + 8, 4096])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_random_masks_match_brute_force(k_len, density):
    # random bits: empty rows, full rows, holes; lengths with and without whole 64-bit words,
    # and word counts with no divisor near 255 (2056 keys = 257 words, a prime)
    generator = torch.Generator().manual_seed(k_len * 1000 + int(density * 100))
    mask = torch.rand(2, 1, 9, k_len, generator=generator) < density
    key_is_pad = torch.rand(2, k_len, generator=generator) < 0.3
    assert_same(mask, key_is_pad)


@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_structured_masks_match_brute_force(window):
    length = 96
    cases = [
        np.zeros((2, length), dtype=np.int64),
        padded_doc_ids([length, 70], length, "right"),
        padded_doc_ids([length, 70], length, "left"),
        packed_doc_ids([40, 33, 23]),
    ]
    for doc_ids in cases:
        assert_same(structured(doc_ids, window), torch.from_numpy(doc_ids < 0))


def test_float_additive_non_contiguous_and_broadcast_masks_match_brute_force():
    allowed = structured(padded_doc_ids([40, 29], 40, "left"), window=6)
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    assert_same(additive)
    # a transposed (column-major) bool mask cannot be read as words: the plain path
    transposed = allowed.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not transposed.numpy().flags.c_contiguous
    assert_same(transposed)
    shared = structured(np.zeros((1, 40), dtype=np.int64), window=6).expand(3, 1, 40, 40)
    assert shared.stride(0) == 0
    assert_same(shared)


def test_blocks_of_rows_are_stitched_without_gaps(monkeypatch):
    monkeypatch.setattr(mask_band, "ROW_CHUNK", 7)  # 56 rows: 8 blocks, the last one partial
    assert_same(structured(packed_doc_ids([20, 17, 19]), window=9))
    # two sequences: a block of rows is then not C-contiguous (rows adjacent, sequences apart)
    two = structured(padded_doc_ids([56, 30], 56, "right"), window=9)
    assert not two[:, 0, 7:14].numpy().flags.c_contiguous
    assert_same(two, torch.from_numpy(padded_doc_ids([56, 30], 56, "right") < 0))


def test_layers_sharing_a_mask_are_measured_once(monkeypatch):
    # 3 sliding + 1 full layer, right-padded: transformers builds two masks (one per layer type)
    # and hands the same tensor to every layer of a type, so two measurements, not four (SDPA's
    # masks are measured by blocks of rows, probes.mask.shapes)
    from probes.mask import verdict as mask_gate

    calls = []
    original = mask_band.intervals_by_rows

    def counting(read_rows, *args, **kwargs):
        calls.append(read_rows)
        return original(read_rows, *args, **kwargs)

    monkeypatch.setattr(mask_band, "intervals_by_rows", counting)
    config = TINY_GEMMA3_CONFIG
    mask_cfg = mask_gate.merged_mask_config(
        {"scenarios": ["right_padded"], "confirm_on_cuda": False}
    )
    table, _ = mask_gate.evaluate(
        config, mask_cfg, {"micro_batch_size": 2, "max_seq_len": 24}, progress=False
    )
    assert len(calls) == 2
    assert table["mask_present"].all()


def test_views_of_one_storage_share_an_identity_and_copies_do_not():
    from probes.mask.layers import mask_identity

    base = structured(np.zeros((2, 16), dtype=np.int64), window=4)
    assert mask_identity(base) == mask_identity(base[:, :, :, :])
    assert mask_identity(base) != mask_identity(base.clone())
    assert mask_identity(base) != mask_identity(base[:, :, :8])  # another view: another shape


def test_heap_reuse_is_scoped_and_leaves_values_alone():
    from probes.mask import memory as mask_memory

    with mask_memory.reuse_freed_memory(enabled=False) as applied:
        assert applied is False
    if mask_memory._glibc() is None:
        pytest.skip("not glibc: the setting is a no-op here")
    with mask_memory.reuse_freed_memory() as applied:
        assert applied is True
        big = torch.ones(64, 1024, 1024, dtype=torch.bool)  # 64 MiB: above any mmap threshold
        del big
        again = torch.zeros(64, 1024, 1024, dtype=torch.bool)
        assert not again.any()  # a reused block is still zeroed by torch.zeros
