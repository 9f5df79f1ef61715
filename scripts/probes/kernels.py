"""The kernel table: torch.profiler rows summed without double counting, grouped into categories.

`key_averages()` lists each ATen op (device_type CPU) and the CUDA kernel it launched
(device_type CUDA) with the same self device time. Summing every row counts GPU time twice; only
the kernel rows are summed here, and the sum is checked against the profiled wall time.
On CPU there are no kernels: the table is built from the self CPU time of the ops (self time is
exclusive, so nested ops are not counted twice either).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd

# Order matters: the first matching category wins (fmha names contain "cutlass" and "sm80").
CATEGORY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("memory_copy", r"memcpy|memset|copy_kernel|aten::copy_|aten::_to_copy|aten::to$|aten::clone"),
    ("optimizer", r"adam|multi_tensor_apply|_foreach|optimizer\.step|sgd"),
    (
        "attention",
        r"flash|fmha|attention|sdpa|scaled_dot_product|mha_|_efficient_attention|cudnn_mha",
    ),
    (
        "gemm",
        r"gemm|cutlass|cublas|nvjet|xmma|grouped_mm|splitk|^aten::(mm|addmm|bmm|matmul|linear|"
        r"baddbmm|addmv|mv|dot)$|^(sm\d+|ampere|volta|turing|hopper)_",
    ),
    (
        "moe_routing_scatter",
        r"moe|topk|scatter|gather|index_add|index_select|index_put|sort|histc|bincount|nonzero|"
        r"masked_select|^aten::index$",
    ),
    (
        "reduction_softmax_ce",
        r"softmax|logsumexp|nll|cross_entropy|reduce|aten::(sum|mean|norm|var|amax|amin|max|min|"
        r"argmax|cumsum|prod|std)$|layer_norm|rms_?norm|lse",
    ),
    (
        "elementwise",
        r"elementwise|vectorized|unrolled|pointwise|triton_poi|^aten::(add|add_|mul|mul_|sub|"
        r"sub_|div|div_|pow|tanh|gelu|silu|exp|exp_|neg|rsqrt|sqrt|where|fill_|zero_|cat|"
        r"masked_fill|masked_fill_|sigmoid|clamp|abs|sin|cos|triu|tril|arange|ones|zeros|"
        r"ones_like|zeros_like|lt|gt|le|ge|eq|ne|bitwise_and|bitwise_or|logical_and|"
        r"logical_not|rsub|reciprocal|addcmul_|addcdiv_|lerp_|threshold|dropout)(_backward)?$",
    ),
)
CATEGORIES = tuple(name for name, _ in CATEGORY_PATTERNS) + ("other",)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CATEGORY_PATTERNS)
# rows that are ranges we (or the profiler) opened, not ops: never summed on CPU
MARKER = re.compile(r"^(ProfilerStep#|probes::|## )")


def categorise_kernel(name: str) -> str:
    lowered = name.lower()
    for category, pattern in _COMPILED:
        if pattern.search(lowered):
            return category
    return "other"


@dataclass(frozen=True)
class ProfileRow:
    name: str
    device_type: str  # CUDA | CPU
    self_time_us: float
    count: int


def rows_from_key_averages(averages: Iterable[Any]) -> list[ProfileRow]:
    """Every key_averages() row with its own device type and self time (device time for kernel
    rows and for the ops that launched them, CPU time for CPU-only ops)."""
    rows = []
    for event in averages:
        device_type = str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1].upper()
        device_self = float(
            getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
        )
        cpu_self = float(getattr(event, "self_cpu_time_total", 0.0))
        rows.append(
            ProfileRow(
                name=str(event.key),
                device_type=device_type,
                self_time_us=device_self if device_type == "CUDA" else cpu_self,
                count=int(getattr(event, "count", 1)),
            )
        )
    return rows


def aten_device_time_us(averages: Iterable[Any]) -> float:
    """What a naive sum over every row's self device time gives (counts kernels twice)."""
    total = 0.0
    for event in averages:
        total += float(
            getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
        )
    return total


def summed_rows(rows: Iterable[ProfileRow], device: str) -> list[ProfileRow]:
    """The rows whose self time is summed: CUDA kernel rows on a GPU, op rows on CPU."""
    wanted = "CUDA" if device == "cuda" else "CPU"
    return [
        r
        for r in rows
        if r.device_type == wanted and r.self_time_us > 0 and not MARKER.search(r.name)
    ]


def category_table(rows: list[ProfileRow], wall_s: float, top: int = 5) -> pd.DataFrame:
    """One row per category: device time, share of the kernel sum and of wall, top kernels."""
    frame = pd.DataFrame(
        [
            {
                "name": r.name,
                "device_type": r.device_type,
                "self_time_us": r.self_time_us,
                "count": r.count,
                "category": categorise_kernel(r.name),
            }
            for r in rows
        ],
        columns=["name", "device_type", "self_time_us", "count", "category"],
    )
    total_us = float(frame["self_time_us"].sum())
    out = []
    for category, group in frame.groupby("category", sort=False):
        group = group.sort_values("self_time_us", ascending=False)
        time_s = float(group["self_time_us"].sum()) / 1e6
        out.append(
            {
                "category": category,
                "device_type": group["device_type"].iloc[0],
                "device_time_s": time_s,
                "share": time_s * 1e6 / total_us if total_us > 0 else float("nan"),
                "share_of_wall": time_s / wall_s if wall_s > 0 else float("nan"),
                "n_kernels": int(len(group)),
                "n_calls": int(group["count"].sum()),
                "top_kernels": [name[:200] for name in group["name"].head(top)],
            }
        )
    columns = [
        "category",
        "device_type",
        "device_time_s",
        "share",
        "share_of_wall",
        "n_kernels",
        "n_calls",
        "top_kernels",
    ]
    table = pd.DataFrame(out, columns=columns)
    return table.sort_values("device_time_s", ascending=False).reset_index(drop=True)


def double_count_check(
    kernel_sum_s: float, wall_s: float, naive_sum_s: float | None, tolerance: float
) -> dict[str, Any]:
    """The positive control for double counting: the summed rows must fit in the wall time."""
    # an empty table (no kernel rows: profiler without CUPTI) would pass trivially; it fails
    passed = 0 < kernel_sum_s <= wall_s * (1.0 + tolerance)
    naive_ratio = naive_sum_s / kernel_sum_s if naive_sum_s and kernel_sum_s > 0 else None
    return {
        "name": "kernel_sum_within_wall_time",
        "description": (
            "the summed kernel rows (device_type CUDA; on CPU the ops' self CPU time) must not "
            "exceed the profiled wall time (and must not be empty); summing ATen op rows as well "
            "would count GPU time twice"
        ),
        "expected": {"kernel_sum_s_max": wall_s * (1.0 + tolerance), "tolerance": tolerance},
        "observed": {
            "kernel_sum_s": kernel_sum_s,
            "wall_s": wall_s,
            "kernel_share_of_wall": kernel_sum_s / wall_s if wall_s > 0 else None,
            "all_rows_self_device_s": naive_sum_s,
            "all_rows_over_kernel_rows": naive_ratio,
        },
        "passed": bool(passed),
    }


def raw_table_header(device: str, steps: int, seq_len: int, batch: int, wall_s: float) -> str:
    if device == "cuda":
        rule = (
            "SUM ONLY the kernel rows (device_type CUDA: the CUDA kernel names, e.g. "
            "'ampere_bf16_...gemm', 'flash_fwd...', 'Memcpy DtoD'). Each aten:: op row above its "
            "kernels carries the SAME self CUDA time as the kernels it launched: summing both "
            "counts GPU time twice. kernels.parquet holds the kernel rows only."
        )
    else:
        rule = (
            "CPU-ONLY RUN: there are no device kernels. The table is summed over the self CPU "
            "time of the op rows (self time excludes children, so nesting is not double counted); "
            "ProfilerStep#/probes:: marker ranges are excluded."
        )
    return (
        f"=== torch.profiler key_averages(): {steps} training step(s), batch {batch} x "
        f"{seq_len} tokens, profiled wall {wall_s:.4f} s ===\n{rule}\n"
    )
