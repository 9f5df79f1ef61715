"""SDPA backend prediction rules, and the torch confirmation path (CPU: must not crash)."""

import pandas as pd
import pytest
import torch

from conftest import REPO
from probes.mask import backend as sb
from probes.mask import confirm as sc


def call(
    q_heads=8,
    kv_heads=8,
    length=1024,
    head_dim=128,
    dtype="bfloat16",
    mask=False,
    is_causal=None,
    enable_gqa=False,
    kv_length=None,
    head_dim_v=None,
) -> sb.SdpaCall:
    kv_length = kv_length or length
    head_dim_v = head_dim_v or head_dim

    def contiguous(shape):
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= size
        return tuple(reversed(strides))

    q = (2, q_heads, length, head_dim)
    k = (2, kv_heads, kv_length, head_dim)
    v = (2, kv_heads, kv_length, head_dim_v)
    return sb.SdpaCall(
        q_shape=q,
        k_shape=k,
        v_shape=v,
        q_stride=contiguous(q),
        k_stride=contiguous(k),
        v_stride=contiguous(v),
        dtype=dtype,
        is_causal=(not mask) if is_causal is None else is_causal,
        enable_gqa=enable_gqa,
        mask_shape=(2, 1, length, kv_length) if mask else None,
        mask_dtype="bool" if mask else None,
        mask_last_stride=1 if mask else None,
    )


H100 = sb.Target(compute_capability=(9, 0))


def test_no_mask_bf16_on_sm90_is_flash():
    prediction = sb.predict_backend(call(), H100)
    assert prediction.backend == sb.FLASH and prediction.excluded == {}


def test_mask_excludes_flash_and_lands_on_efficient():
    prediction = sb.predict_backend(call(mask=True), H100)
    assert prediction.backend == sb.EFFICIENT
    assert "attn_mask present" in prediction.excluded[sb.FLASH]


def test_head_dim_above_256_excludes_flash():
    prediction = sb.predict_backend(call(head_dim=512), H100)
    assert prediction.backend == sb.EFFICIENT
    assert prediction.excluded[sb.FLASH] == "head_dim 512 > 256"


def test_float32_excludes_flash_by_dtype():
    prediction = sb.predict_backend(call(dtype="float32"), H100)
    assert prediction.backend == sb.EFFICIENT
    assert prediction.excluded[sb.FLASH].startswith("dtype float32")


def test_turing_bf16_falls_to_math():
    prediction = sb.predict_backend(call(), sb.Target(compute_capability=(7, 5)))
    assert prediction.backend == sb.MATH
    assert "outside flash's" in prediction.excluded[sb.FLASH]
    assert "bfloat16" in prediction.excluded[sb.EFFICIENT]


def test_gqa_needs_enable_gqa_for_flash():
    without = sb.predict_backend(call(q_heads=8, kv_heads=2), H100)
    assert "num_heads differ" in without.excluded[sb.FLASH]
    with_gqa = sb.predict_backend(call(q_heads=8, kv_heads=2, enable_gqa=True), H100)
    assert with_gqa.backend == sb.FLASH


def test_causal_with_non_square_lengths_excludes_flash():
    prediction = sb.predict_backend(call(length=16, kv_length=32, is_causal=True), H100)
    assert prediction.excluded[sb.FLASH] == "is_causal with seqlen_q != seqlen_k"


def test_new_cudnn_on_sm90_is_tried_first():
    target = sb.Target(compute_capability=(9, 0), cudnn_version=91600)
    assert target.priority_order()[0] == sb.CUDNN
    assert sb.predict_backend(call(), target).backend == sb.CUDNN
    # cuDNN < 9.22 caps head_dim at 128: a 256-wide head falls back to flash
    wide = sb.predict_backend(call(head_dim=256), target)
    assert wide.backend == sb.FLASH and "head_dim 256 > 128" in wide.excluded[sb.CUDNN]


def test_torch_2_11_sends_256_wide_heads_to_cudnn_as_measured_on_h200():
    # docs/evidence/h200-2026-11-30: torch 2.11 + cuDNN 9.19 chose cuDNN for head_dim 256
    target = sb.Target(compute_capability=(9, 0), cudnn_version=91900, torch_version="2.11.0+cu130")
    assert sb.predict_backend(call(head_dim=256), target).backend == sb.CUDNN
    newer = sb.Target(compute_capability=(9, 0), cudnn_version=91900, torch_version="2.13.0")
    assert sb.predict_backend(call(head_dim=256), newer).backend == sb.FLASH


def test_unknown_cudnn_keeps_default_order():
    assert sb.Target(compute_capability=(9, 0)).priority_order() == sb.DEFAULT_ORDER
    assert sb.Target(compute_capability=(8, 0), cudnn_version=91600).priority_order() == (
        sb.DEFAULT_ORDER
    )


@pytest.mark.parametrize(
    "text, expected",
    [("9.0", (9, 0)), ("sm90", (9, 0)), ("8.6", (8, 6)), ("120", (12, 0)), (9.0, (9, 0))],
)
def test_parse_compute_capability(text, expected):
    assert sb.parse_compute_capability(text) == expected


def test_parse_compute_capability_rejects_garbage():
    with pytest.raises(ValueError, match="compute capability"):
        sb.parse_compute_capability("hopper")


def test_confirmation_without_cuda_is_a_not_run_record_with_its_reason(monkeypatch):
    # torch's CUDA dispatch cannot be asked on a CPU: nothing is run and the record says why
    small = call(q_heads=2, kv_heads=2, length=8, head_dim=16, mask=True)
    result = sc.confirm_with_torch(small, device="cpu", requires_grad=True)
    assert result["ran"] is False and result["backend"] is None and result["can_use"] == {}
    assert result["reason"].startswith(sc.NO_CUDA) and "'cpu'" in result["reason"]
    # asking for "cuda" on a machine without one gives the same record, not a crash
    monkeypatch.setattr(sc, "cuda_available", lambda: False)
    assert sc.confirm_with_torch(small, device="cuda")["ran"] is False


EVIDENCE = REPO / "docs" / "evidence" / "h200-2026-11-30"


def calls_from_evidence(table: pd.DataFrame) -> list[tuple[sb.SdpaCall, str]]:
    """The SDPA calls of a layers.parquet and the backend torch chose for each on the H200."""
    out = []
    for row in table.itertuples():
        # repeat_kv hands SDPA as many k/v heads as q heads; enable_gqa the module's own
        k_heads = row.q_heads if row.gqa_path == "repeat_kv" else row.kv_heads
        example = call(
            q_heads=row.q_heads,
            kv_heads=k_heads,
            length=row.seq_len,
            head_dim=row.head_dim,
            head_dim_v=row.head_dim_v,
            mask=bool(row.mask_present),
            is_causal=bool(row.is_causal),
            enable_gqa=bool(row.enable_gqa),
        )
        batch = row.batch
        example = sb.SdpaCall(
            **{
                **example.__dict__,
                "q_shape": (batch, *example.q_shape[1:]),
                "k_shape": (batch, *example.k_shape[1:]),
                "v_shape": (batch, *example.v_shape[1:]),
                "mask_shape": (batch, 1, row.seq_len, row.seq_len) if row.mask_present else None,
            }
        )
        out.append((example, row.confirmed_backend))
    return out


@pytest.mark.parametrize("model", ["mask-gemma-3-270m", "mask-gemma-3-27b"])
def test_default_target_for_torch_2_11_predicts_what_the_h200_ran(model):
    # docs/evidence: torch 2.11.0+cu130 on an H200 ran every call in cuDNN (126 and 496 calls).
    # With no cuDNN configured, the target takes the cuDNN torch 2.11's wheel bundles.
    table = pd.read_parquet(EVIDENCE / model / "layers.parquet")
    target = sb.resolve_target((9, 0), "2.11.0+cu130")
    assert target.cudnn_version == 91900 and "bundled" in target.cudnn_version_source
    recorded = calls_from_evidence(table)
    assert len(recorded) == {"mask-gemma-3-270m": 126, "mask-gemma-3-27b": 496}[model]
    predicted = [sb.predict_backend(example, target).backend for example, _ in recorded]
    assert predicted == [ran for _, ran in recorded]
    # the old default (cuDNN unknown -> flash first) is what the first H200 run disagreed with
    unknown = sb.Target(compute_capability=(9, 0), torch_version="2.11.0+cu130")
    assert sb.predict_backend(recorded[0][0], unknown).backend != recorded[0][1]


@pytest.mark.parametrize(
    "torch_version, cc, first",
    [
        ("2.4.1", (9, 0), sb.FLASH),  # cuDNN tried last (opt-in only)
        ("2.5.1", (9, 0), sb.CUDNN),  # 2.5: the H100 default
        ("2.5.1", (8, 0), sb.FLASH),
        ("2.7.1", (9, 0), sb.FLASH),  # deprioritised again (#138522)
        ("2.9.0", (9, 0), sb.CUDNN),  # #162073: built with cuDNN 9.10 >= 9.9
        ("2.9.0", (8, 9), sb.FLASH),
        ("2.10.0", (9, 0), sb.FLASH),  # bundled cuDNN 9.10.2 is not > 9.15.0
        ("2.11.0", (9, 0), sb.CUDNN),  # cu130 wheel, cuDNN 9.19
        ("2.11.0", (8, 0), sb.FLASH),
        ("2.11.0+cu130", (10, 1), sb.CUDNN),  # CUDA 13 builds: any sm10x
        ("2.11.0+cu128", (10, 1), sb.FLASH),  # CUDA 12 builds: sm90, sm100, sm103 only
        ("2.11.0+cu128", (10, 3), sb.CUDNN),
    ],
)
def test_priority_order_follows_the_torch_release(torch_version, cc, first):
    target = sb.resolve_target(cc, torch_version)
    assert target.priority_order()[0] == first
    assert sb.predict_backend(call(), target).backend == first


def test_release_newer_than_the_table_assumes_the_newest_bundle_and_says_so():
    target = sb.resolve_target((9, 0), "2.13.0+cpu")
    newest = max(sb.BUNDLED_CUDNN)
    assert target.cudnn_version == sb.BUNDLED_CUDNN[newest][0]
    assert target.cudnn_version_source.startswith("bundled with torch 2.13.0+cpu: assumed")
    assert sb.target_as_dict(target)["cudnn_first_rule"].startswith(sb.CUDNN_ABOVE_9_15)
    # an explicit cuDNN wins over the bundle
    older = sb.resolve_target((9, 0), "2.13.0", cudnn_version=91002)
    assert older.cudnn_version == 91002 and older.priority_order()[0] == sb.FLASH


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prediction_matches_torch_on_this_gpu():
    target = sc.local_target(requires_grad=True)
    for example in (
        call(),
        call(mask=True),
        call(head_dim=512),
        call(q_heads=8, kv_heads=2, enable_gqa=True),
    ):
        predicted = sb.predict_backend(example, target).backend
        assert sc.confirm_with_torch(example, "cuda")["backend"] == predicted, example
