"""Kernel table: categories, device-rows-only sums, and the double-count control."""

import time
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from probes.step.kernels import (
    ROUTING,
    categorise_kernel,
    category_table,
    device_event_kinds,
    double_count_check,
    excluded_annotations,
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
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x256",
            "attention",
        ),
        # cuDNN's SDPA backward helpers (6.7 ms landed in "other" on the H200)
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 256>(void const*)", "attention"),
        ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", "attention"),
        ("void cudnn::fusion::fmha_reduce_head<true>(void const*, void*)", "attention"),
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
        # "false" in a template argument list is not a log-sum-exp
        ("void at::native::(anonymous namespace)::write_indices<long, false>(long*)", "other"),
    ],
)
def test_kernel_categories(name, category):
    assert categorise_kernel(name) == category


def row(key, device_type, device_us, cpu_us=5.0, count=1, annotation=False):
    return SimpleNamespace(
        key=key,
        device_type=device_type,
        self_device_time_total=device_us,
        self_cpu_time_total=cpu_us,
        count=count,
        is_user_annotation=annotation,
    )


# the device rows that are kernels, memcpy or memset, in microseconds: what the sum must be
KERNEL_US = 600.0 + 300.0 + 50.0 + 5.0


def fake_averages():
    """key_averages() as it looks on a GPU: each ATen op row carries the same self device time
    as the kernel row it launched; record_function ranges appear twice, as a CPU annotation and
    as a device-typed gpu_user_annotation spanning the kernels inside it."""
    return [
        row("aten::mm", DeviceType.CPU, 600.0, 40.0, 3),
        row("sm90_xmma_gemm_bf16bf16_bf16f32", DeviceType.CUDA, 600.0, 0.0, 3),
        row("aten::_efficient_attention_forward", DeviceType.CPU, 300.0, 20.0),
        row("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", DeviceType.CUDA, 300.0, 0.0),
        row("aten::mul", DeviceType.CPU, 50.0, 10.0),
        row("void at::native::vectorized_elementwise_kernel<4>", DeviceType.CUDA, 50.0, 0.0),
        row("Memset (Device)", DeviceType.CUDA, 5.0, 0.0, 4),
        row("ProfilerStep*", DeviceType.CPU, 0.0, 900.0),
        # the optimizer's own range, on the CPU and on the device (1.01 ms on the H200)
        row("Optimizer.step#AdamW.step", DeviceType.CPU, 0.0, 300.0, annotation=True),
        row("Optimizer.step#AdamW.step", DeviceType.CUDA, 60.0, 0.0, annotation=True),
        # a harness that wraps its whole step in record_function: spans every kernel
        row("harness_step", DeviceType.CPU, 0.0, 950.0, annotation=True),
        row("harness_step", DeviceType.CUDA, KERNEL_US, 0.0, annotation=True),
    ]


def test_only_device_kernel_memcpy_memset_rows_are_summed():
    rows = rows_from_key_averages(fake_averages())
    summed = summed_rows(rows, "cuda")
    assert [r.name for r in summed] == [
        "sm90_xmma_gemm_bf16bf16_bf16f32",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
        "void at::native::vectorized_elementwise_kernel<4>",
        "Memset (Device)",
    ]
    assert [r.kind for r in summed] == ["kernel", "kernel", "kernel", "memset"]
    table = category_table(summed, wall_s=0.0012)
    assert table["device_time_s"].sum() == pytest.approx(KERNEL_US / 1e6)
    assert table["share"].sum() == pytest.approx(1.0)
    assert set(table["category"]) == {"gemm", "attention", "elementwise", "memory_copy"}
    assert "optimizer" not in set(table["category"])  # the annotation is not an optimizer kernel
    assert table.loc[table["category"] == "gemm", "n_calls"].item() == 3


def test_annotations_are_left_out_and_the_wall_check_holds():
    averages = fake_averages()
    rows = rows_from_key_averages(averages)
    wall_s = 0.0012  # 1.2 ms of wall for 0.955 ms of kernels
    kernel_sum = category_table(summed_rows(rows, "cuda"), wall_s)["device_time_s"].sum()
    excluded = excluded_annotations(rows, "cuda")
    assert excluded["annotation_rows_excluded"] == 2
    assert excluded["annotation_time_excluded_s"] == pytest.approx((60.0 + KERNEL_US) / 1e6)
    good = double_count_check(kernel_sum, wall_s, None, tolerance=0.01, excluded=excluded)
    assert good["passed"] is True
    # every device-typed row (the old filter) takes the harness's range in on top of its own
    # kernels, and the check catches it
    device_typed = sum(
        a.self_device_time_total for a in averages if a.device_type != DeviceType.CPU
    )
    assert device_typed == pytest.approx(2 * KERNEL_US + 60.0)
    assert double_count_check(device_typed / 1e6, wall_s, None, tolerance=0.01)["passed"] is False


def test_double_count_control_catches_summing_every_row():
    averages = fake_averages()
    wall_s = 0.0012
    kernel_sum = category_table(summed_rows(rows_from_key_averages(averages), "cuda"), wall_s)[
        "device_time_s"
    ].sum()
    naive = sum(a.self_device_time_total for a in averages) / 1e6  # ops + kernels + ranges
    good = double_count_check(kernel_sum, wall_s, naive, tolerance=0.01)
    assert good["passed"] is True
    assert good["observed"]["all_rows_over_kernel_rows"] == pytest.approx(
        (2 * 950.0 + 5.0 + 60.0 + KERNEL_US) / KERNEL_US
    )
    bad = double_count_check(naive, wall_s, naive, tolerance=0.01)
    assert bad["passed"] is False


def test_annotations_without_the_flag_are_caught_by_kind_or_name():
    # an older torch without is_user_annotation: the kineto activity type says what a row is
    bare = [
        SimpleNamespace(**{k: v for k, v in vars(a).items() if k != "is_user_annotation"})
        for a in fake_averages()
    ]
    kinds = {
        ("harness_step", "CUDA"): "gpu_user_annotation",
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "CUDA"): "kernel",
        ("Memset (Device)", "CUDA"): "gpu_memset",
        ("Stream Sync", "CUDA"): "cuda_sync",
    }
    rows = rows_from_key_averages(
        [*bare, row("Stream Sync", DeviceType.CUDA, 400.0)], activities=kinds
    )
    summed = summed_rows(rows, "cuda")
    assert sum(r.self_time_us for r in summed) == pytest.approx(KERNEL_US)
    assert {r.name for r in rows if r.kind == "annotation"} >= {
        "harness_step",
        "Optimizer.step#AdamW.step",
    }
    assert next(r for r in rows if r.name == "Stream Sync").kind == "other_device"


def test_cpu_rows_use_self_cpu_time_and_skip_markers_and_annotations():
    rows = rows_from_key_averages(fake_averages())
    summed = summed_rows(rows, "cpu")
    names = [r.name for r in summed]
    assert "ProfilerStep*" not in names and "harness_step" not in names
    assert "Optimizer.step#AdamW.step" not in names
    assert sum(r.self_time_us for r in summed) == pytest.approx(40.0 + 20.0 + 10.0)
    assert "CPU-ONLY" in raw_table_header("cpu", 1, 128, 2, 0.5)
    assert "SUM ONLY the device kernel" in raw_table_header("cuda", 3, 4096, 2, 1.0)


def test_an_empty_kernel_table_fails_the_control():
    # a profiler without CUPTI lists no kernel rows: 0 <= wall must not pass as "no double count"
    assert double_count_check(0.0, 1.0, None, tolerance=0.01)["passed"] is False


def test_recorded_cpu_profile_leaves_the_harness_range_out():
    """A real torch.profiler recording of a step wrapped in record_function (as a harness may
    do): the range and the optimizer's annotation are recorded, and neither is summed."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        begin = time.perf_counter()
        with record_function("harness_step"):
            model(torch.randn(16, 32)).square().mean().backward()
            optimizer.step()
        wall_s = time.perf_counter() - begin
    averages = prof.key_averages()
    kinds = device_event_kinds(prof)
    assert kinds[("harness_step", "CPU")] == "user_annotation"
    assert kinds[("aten::addmm", "CPU")] == "cpu_op"
    rows = rows_from_key_averages(averages, kinds)
    recorded = {r.name: r for r in rows}
    assert recorded["harness_step"].kind == "annotation"
    assert recorded["Optimizer.step#AdamW.step"].kind == "annotation"
    summed = summed_rows(rows, "cpu")
    assert summed and all(r.kind == "op" for r in summed)
    assert "harness_step" not in {r.name for r in summed}
    kernel_sum = sum(r.self_time_us for r in summed) / 1e6
    assert double_count_check(kernel_sum, wall_s, None, tolerance=0.01)["passed"] is True
    # the range's own self time is real and would have been added on top
    assert recorded["harness_step"].self_time_us > 0
    # without the is_user_annotation flag (older torch) the recorded event kind still says so
    bare = [
        SimpleNamespace(
            key=a.key,
            device_type=a.device_type,
            self_device_time_total=0.0,
            self_cpu_time_total=a.self_cpu_time_total,
            count=a.count,
        )
        for a in averages
        if a.key == "harness_step"
    ]
    assert rows_from_key_averages(bare, kinds)[0].kind == "annotation"


@pytest.mark.parametrize(
    ("name", "has_experts", "category"),
    [
        ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", True, ROUTING),
        ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", False, "elementwise"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", False, "other"),
        ("cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<long>", False, "other"),
        ("cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<long>", True, ROUTING),
    ],
)
def test_routing_only_for_models_with_experts(name, has_experts, category):
    assert categorise_kernel(name, has_experts) == category
