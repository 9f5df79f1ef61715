"""Kernel table: categories, device-rows-only sums, and the double-count control."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from probes.kernels import (
    categorise_kernel,
    category_table,
    double_count_check,
    raw_table_header,
    rows_from_key_averages,
    summed_rows,
)


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        (
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
            "attention",
        ),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>", "attention"),
        ("Memcpy DtoD (Device -> Device)", "memory_copy"),
        ("void at::native::(anonymous namespace)::direct_copy_kernel_cuda", "memory_copy"),
        (
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMath>",
            "optimizer",
        ),
        (
            "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>",
            "reduction_softmax_ce",
        ),
        (
            "void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps<float>>>",
            "reduction_softmax_ce",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, AUnaryFunctor<BFloat16>>",
            "elementwise",
        ),
        ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", "moe_routing_scatter"),
        (
            "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>",
            "moe_routing_scatter",
        ),
        ("aten::mm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::mul", "elementwise"),
        ("aten::logsumexp", "reduction_softmax_ce"),
        ("aten::_foreach_add_", "optimizer"),
        ("aten::copy_", "memory_copy"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_categories(name, category):
    assert categorise_kernel(name) == category


def fake_averages():
    """key_averages() as it looks on a GPU: each ATen op row carries the same self device time
    as the kernel row it launched."""

    def row(key, device_type, device_us, cpu_us=5.0, count=1):
        return SimpleNamespace(
            key=key,
            device_type=device_type,
            self_device_time_total=device_us,
            self_cpu_time_total=cpu_us,
            count=count,
        )

    return [
        row("aten::mm", DeviceType.CPU, 600.0, 40.0, 3),
        row("sm90_xmma_gemm_bf16bf16_bf16f32", DeviceType.CUDA, 600.0, 0.0, 3),
        row("aten::_efficient_attention_forward", DeviceType.CPU, 300.0, 20.0),
        row("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", DeviceType.CUDA, 300.0, 0.0),
        row("aten::mul", DeviceType.CPU, 50.0, 10.0),
        row("void at::native::vectorized_elementwise_kernel<4>", DeviceType.CUDA, 50.0, 0.0),
        row("ProfilerStep#1", DeviceType.CPU, 0.0, 900.0),
    ]


def test_only_cuda_kernel_rows_are_summed():
    rows = rows_from_key_averages(fake_averages())
    summed = summed_rows(rows, "cuda")
    assert [r.device_type for r in summed] == ["CUDA"] * 3
    table = category_table(summed, wall_s=0.0012)
    assert table["device_time_s"].sum() == pytest.approx(950e-6)
    assert table["share"].sum() == pytest.approx(1.0)
    assert set(table["category"]) == {"gemm", "attention", "elementwise"}
    assert table.loc[table["category"] == "gemm", "n_calls"].item() == 3


def test_double_count_control_catches_summing_every_row():
    averages = fake_averages()
    wall_s = 0.0012  # 1.2 ms of wall for 0.95 ms of kernels
    kernel_sum = category_table(summed_rows(rows_from_key_averages(averages), "cuda"), wall_s)[
        "device_time_s"
    ].sum()
    naive = sum(a.self_device_time_total for a in averages) / 1e6  # ATen + kernel rows: 1.9 ms
    good = double_count_check(kernel_sum, wall_s, naive, tolerance=0.01)
    assert good["passed"] is True
    assert good["observed"]["all_rows_over_kernel_rows"] == pytest.approx(2.0)
    bad = double_count_check(naive, wall_s, naive, tolerance=0.01)
    assert bad["passed"] is False


def test_cpu_rows_use_self_cpu_time_and_skip_markers():
    rows = rows_from_key_averages(fake_averages())
    summed = summed_rows(rows, "cpu")
    assert "ProfilerStep#1" not in [r.name for r in summed]
    assert sum(r.self_time_us for r in summed) == pytest.approx(70.0)
    assert "CPU-ONLY" in raw_table_header("cpu", 1, 128, 2, 0.5)
    assert "SUM ONLY the kernel rows" in raw_table_header("cuda", 3, 4096, 2, 1.0)


def test_an_empty_kernel_table_fails_the_control():
    # a profiler without CUPTI lists no kernel rows: 0 <= wall must not pass as "no double count"
    assert double_count_check(0.0, 1.0, None, tolerance=0.01)["passed"] is False
