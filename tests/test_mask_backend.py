"""SDPA backend prediction rules, and the torch confirmation path (CPU: must not crash)."""

import pytest
import torch

from probes import sdpa_backend as sb


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


def test_confirm_path_runs_on_cpu_without_crashing():
    # the CUDA checks answer False on CPU tensors, but the whole code path executes
    small = call(q_heads=2, kv_heads=2, length=8, head_dim=16, mask=True)
    result = sb.confirm_with_torch(small, device="cpu", requires_grad=True)
    assert result["can_use"] == {sb.FLASH: False, sb.EFFICIENT: False, sb.CUDNN: False}
    assert result["backend"] in {sb.MATH, sb.FLASH, sb.EFFICIENT, sb.CUDNN, None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prediction_matches_torch_on_this_gpu():
    target = sb.local_target(requires_grad=True)
    for example in (
        call(),
        call(mask=True),
        call(head_dim=512),
        call(q_heads=8, kv_heads=2, enable_gqa=True),
    ):
        predicted = sb.predict_backend(example, target).backend
        assert sb.confirm_with_torch(example, "cuda")["backend"] == predicted, example
