"""The kernel table: torch.profiler rows summed without double counting, grouped into categories.

`key_averages()` lists each ATen op (device_type CPU) and the CUDA kernel it launched
(device_type CUDA) with the same self device time. It also lists user annotations: ranges opened
with `record_function` (the optimizer's `Optimizer.step#AdamW.step`, a harness's own ranges),
which on a GPU appear a second time as device-typed `gpu_user_annotation` rows spanning the
kernels inside them. Only device events of kind kernel, memcpy and memset are summed here (the
event kind from the profiler's kineto events where available, else `is_user_annotation` and the
name); the sum is checked against the profiled wall time. On CPU there are no kernels: the table
is built from the self CPU time of the ATen op rows (self time is exclusive, so nested ops are not
counted twice); annotations and marker ranges are excluded there too.
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
        # cuDNN's SDPA backward helpers (dO.O dot products, dQ conversion, head reductions)
        # belong to attention, like the fprop/bprop kernels themselves
        "attention",
        r"flash|fmha|attention|sdpa|scaled_dot_product|mha_|_efficient_attention|cudnn_mha|"
        r"cudnn::fusion::(compute_dot_do_o|convert_dq|dot_do_o)",
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
        r"argmax|cumsum|prod|std)$|layer_norm|rms_?norm|(^|[^a-z])lse([^a-z]|$)",
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
ROUTING = "moe_routing_scatter"  # only for models with experts
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CATEGORY_PATTERNS)
# rows that are ranges we (or the profiler) opened, not ops: never summed
MARKER = re.compile(r"^(ProfilerStep[#*]|probes::|## )")
# record_function ranges of torch's optimizers ("Optimizer.step#AdamW.step",
# "Optimizer.zero_grad#AdamW.zero_grad"): annotations, also where a profiler lacks the flag
ANNOTATION_NAME = re.compile(r"^Optimizer\.\w+#")

# What a row is. Only DEVICE_KINDS are summed on a GPU, only OP on CPU.
KERNEL, MEMCPY, MEMSET, ANNOTATION, OP, OTHER_DEVICE = (
    "kernel",
    "memcpy",
    "memset",
    "annotation",
    "op",
    "other_device",
)
DEVICE_KINDS = (KERNEL, MEMCPY, MEMSET)
# kineto activity types (torch's _KinetoEvent.activity_type()) -> row kind
ACTIVITY_KINDS = {
    "kernel": KERNEL,
    "gpu_memcpy": MEMCPY,
    "gpu_memset": MEMSET,
    "gpu_user_annotation": ANNOTATION,
    "user_annotation": ANNOTATION,
    "cpu_op": OP,
}


def categorise_kernel(name: str, has_experts: bool = True) -> str:
    """The first category whose pattern matches; MoE routing only for a model with experts
    (nonzero/gather/sort in a dense model are not routing: they fall through)."""
    lowered = name.lower()
    for category, pattern in _COMPILED:
        if category == ROUTING and not has_experts:
            continue
        if pattern.search(lowered):
            return category
    return "other"


@dataclass(frozen=True)
class ProfileRow:
    name: str
    device_type: str  # CUDA | CPU
    self_time_us: float
    count: int
    kind: str = OP  # kernel | memcpy | memset | annotation | op | other_device


def _device_type(event: Any) -> str:
    return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1].upper()


def row_kind(
    name: str, device_type: str, is_user_annotation: bool, activity: str | None = None
) -> str:
    """What a key_averages() row is: a device kernel / memcpy / memset, a CPU op, an annotation
    (record_function range, on either device), or another device event."""
    if is_user_annotation or MARKER.search(name) or ANNOTATION_NAME.search(name):
        return ANNOTATION
    if activity is not None and activity in ACTIVITY_KINDS:
        kind = ACTIVITY_KINDS[activity]
        if device_type == "CPU" or kind != OP:
            return kind
    if device_type == "CPU":
        return OP
    if activity is not None:  # a device event of another kind (e.g. a sync event)
        return OTHER_DEVICE
    lowered = name.lower()
    if lowered.startswith("memcpy"):
        return MEMCPY
    if lowered.startswith("memset"):
        return MEMSET
    return KERNEL


def device_event_kinds(prof: Any) -> dict[tuple[str, str], str]:
    """(name, device type) -> kineto activity type of the profiled events, or {} when this
    torch does not expose them; key_averages() names are matched against these."""
    try:
        events = prof.profiler.kineto_results.events()
        from torch.autograd.profiler_util import _rewrite_name  # the names key_averages() shows
    except (AttributeError, ImportError, RuntimeError):
        return {}
    kinds: dict[tuple[str, str], str] = {}
    for event in events:
        try:
            activity = str(event.activity_type())
            name = _rewrite_name(name=event.name(), with_wildcard=True)
            device_type = str(event.device_type()).rsplit(".", 1)[-1].upper()
        except (AttributeError, RuntimeError, TypeError):
            return {}
        kinds.setdefault((str(name), device_type), activity)
    return kinds


def rows_from_key_averages(
    averages: Iterable[Any], activities: dict[tuple[str, str], str] | None = None
) -> list[ProfileRow]:
    """Every key_averages() row with its own device type, kind and self time (device time for
    device rows, CPU time for CPU rows)."""
    rows = []
    activities = activities or {}
    for event in averages:
        device_type = _device_type(event)
        name = str(event.key)
        device_self = float(
            getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
        )
        cpu_self = float(getattr(event, "self_cpu_time_total", 0.0))
        rows.append(
            ProfileRow(
                name=name,
                device_type=device_type,
                self_time_us=device_self if device_type != "CPU" else cpu_self,
                count=int(getattr(event, "count", 1)),
                kind=row_kind(
                    name,
                    device_type,
                    bool(getattr(event, "is_user_annotation", False)),
                    activities.get((name, device_type)),
                ),
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
    """The rows whose self time is summed: device kernel / memcpy / memset rows on a GPU (never
    ops, never annotations), ATen op rows on CPU."""
    if device == "cuda":
        return [
            r
            for r in rows
            if r.device_type != "CPU" and r.kind in DEVICE_KINDS and r.self_time_us > 0
        ]
    return [r for r in rows if r.device_type == "CPU" and r.kind == OP and r.self_time_us > 0]


def excluded_annotations(rows: Iterable[ProfileRow], device: str) -> dict[str, Any]:
    """The annotation rows left out of the sum on this device (count and their self time)."""
    wanted = (lambda r: r.device_type != "CPU") if device == "cuda" else (lambda r: True)
    kept = [r for r in rows if r.kind == ANNOTATION and wanted(r)]
    return {
        "annotation_rows_excluded": len(kept),
        "annotation_time_excluded_s": sum(r.self_time_us for r in kept) / 1e6,
        "annotation_names_excluded": sorted({r.name[:80] for r in kept})[:10],
    }


def category_table(
    rows: list[ProfileRow], wall_s: float, top: int = 5, has_experts: bool = True
) -> pd.DataFrame:
    """One row per category: device time, share of the kernel sum and of wall, top kernels."""
    frame = pd.DataFrame(
        [
            {
                "name": r.name,
                "device_type": r.device_type,
                "self_time_us": r.self_time_us,
                "count": r.count,
                "kind": r.kind,
                "category": categorise_kernel(r.name, has_experts),
            }
            for r in rows
        ],
        columns=["name", "device_type", "self_time_us", "count", "kind", "category"],
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
                "event_kinds": sorted(set(group["kind"])),
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
        "event_kinds",
        "top_kernels",
    ]
    table = pd.DataFrame(out, columns=columns)
    return table.sort_values("device_time_s", ascending=False).reset_index(drop=True)


def double_count_check(
    kernel_sum_s: float,
    wall_s: float,
    naive_sum_s: float | None,
    tolerance: float,
    excluded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The positive control for double counting: the summed rows must fit in the wall time."""
    # an empty table (no kernel rows: profiler without CUPTI) would pass trivially; it fails
    passed = 0 < kernel_sum_s <= wall_s * (1.0 + tolerance)
    naive_ratio = naive_sum_s / kernel_sum_s if naive_sum_s and kernel_sum_s > 0 else None
    return {
        "name": "kernel_sum_within_wall_time",
        "description": (
            "the summed rows (device kernel, memcpy and memset events; on CPU the ATen ops' self "
            "CPU time; never user annotations) must not exceed the profiled wall time (and must "
            "not be empty); summing ATen op rows or annotation ranges as well would count GPU "
            "time twice"
        ),
        "expected": {"kernel_sum_s_max": wall_s * (1.0 + tolerance), "tolerance": tolerance},
        "observed": {
            "kernel_sum_s": kernel_sum_s,
            "wall_s": wall_s,
            "kernel_share_of_wall": kernel_sum_s / wall_s if wall_s > 0 else None,
            "all_rows_self_device_s": naive_sum_s,
            "all_rows_over_kernel_rows": naive_ratio,
            **(excluded or {}),
        },
        "passed": bool(passed),
    }


def raw_table_header(device: str, steps: int, seq_len: int, batch: int, wall_s: float) -> str:
    if device == "cuda":
        rule = (
            "SUM ONLY the device kernel, memcpy and memset rows (the CUDA kernel names, e.g. "
            "'ampere_bf16_...gemm', 'flash_fwd...', 'Memcpy DtoD'). Each aten:: op row above its "
            "kernels carries the SAME self CUDA time as the kernels it launched, and user "
            "annotations (record_function ranges such as 'Optimizer.step#AdamW.step') span "
            "kernels listed on their own: summing them counts GPU time twice. kernels.parquet "
            "holds the kernel, memcpy and memset rows only."
        )
    else:
        rule = (
            "CPU-ONLY RUN: there are no device kernels. The table is summed over the self CPU "
            "time of the op rows (self time excludes children, so nesting is not double counted); "
            "ProfilerStep#/probes:: markers and user annotations (record_function ranges) are "
            "excluded."
        )
    return (
        f"=== torch.profiler key_averages(): {steps} training step(s), batch {batch} x "
        f"{seq_len} tokens, profiled wall {wall_s:.4f} s ===\n{rule}\n"
    )
