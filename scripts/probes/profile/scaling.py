"""The profile's step-time probes: scaling points and their fit frame, the FLOP model and its
FlopCounterMode control, and the kernel table of one profiled step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from probes.profile import flops as fl
from probes.step import batches as bt
from probes.step import kernels as kn
from probes.step.fit import QuadraticFit, term_shares
from probes.step.runner import Settings, StepRunner
from probes.step.timing import OK, release_memory, synchronize

LOG = logging.getLogger("probes.profile")


@dataclass(frozen=True)
class FlopModel:
    """What the MFU convention needs about the model as it trains (see probes.profile.flops)."""

    params: fl.StepParameters
    head_positions: str  # "loss" | "all": where the harness runs the LM head
    active_params: int  # the base model's active parameters (the dense 6N reading)
    text_config: Mapping[str, Any]

    def step_flops(self, batch: Mapping[str, torch.Tensor]) -> fl.StepFlops:
        """Analytic model FLOPs of one step on `batch` (rows of its attention_mask length)."""
        rows, width = batch["input_ids"].shape
        mask = batch.get("attention_mask")
        lengths = mask.sum(dim=1).tolist() if mask is not None else [width] * rows
        n_tokens = int(sum(lengths))
        head_tokens = (
            bt.loss_position_count(batch["labels"]) if self.head_positions == "loss" else n_tokens
        )
        attention = fl.attention_training_flops(self.text_config, [int(n) for n in lengths])
        return fl.lora_step_flops(self.params, n_tokens, head_tokens, attention)

    def dense_6n_flops(self, n_tokens: int, attention_flops: float) -> float:
        return fl.training_step_flops(self.active_params, n_tokens, attention_flops)


def run_scaling(
    runner: StepRunner,
    settings: Settings,
    loss_share: float,
    vocab_size: int,
    flop_model: FlopModel,
    peak_tflops: float | None,
) -> pd.DataFrame:
    """One row per length: the step's median time, spread, peak memory, MFU; OOM rows go on."""
    rows = []
    generator = torch.Generator().manual_seed(settings.seed)
    for length in tqdm(settings.lengths, desc="scaling", unit="len"):
        batch = bt.to_device(
            bt.uniform_batch(settings.micro_batch, length, loss_share, vocab_size, generator),
            settings.device,
        )
        flops = flop_model.step_flops(batch)
        timing = runner.timed([batch], settings.warmup, settings.repeats)
        del batch
        release_memory(settings.device)
        tokens = settings.micro_batch * length
        dense_6n = flop_model.dense_6n_flops(tokens, flops.attention)
        LOG.info(
            "scaling %d x %d: %s median %.4f s over %d repeat(s)",
            settings.micro_batch,
            length,
            timing.status,
            timing.time_s,
            len(timing.times_s),
        )
        rows.append(
            {
                "seq_len": length,
                "batch": settings.micro_batch,
                "tokens": tokens,
                "status": timing.status,
                "time_s": timing.time_s,
                "time_std_s": timing.time_std_s,
                "times_s": timing.times_s,
                "n_repeats": len(timing.times_s),
                "warmup": settings.warmup,
                "timer": timing.timer,
                "tokens_per_s": tokens / timing.time_s if timing.status == OK else float("nan"),
                "peak_mem_bytes": timing.peak_mem_bytes,
                "memory_kind": timing.memory_kind,
                "model_flops": flops.total,
                "frozen_flops": flops.frozen,
                "trainable_flops": flops.trainable,
                "head_flops": flops.head,
                "attention_flops": flops.attention,
                "head_tokens": flops.head_tokens,
                "mfu": fl.mfu(flops.total, timing.time_s, peak_tflops),
                "dense_6n_flops": dense_6n,
                "mfu_dense_6n": fl.mfu(dense_6n, timing.time_s, peak_tflops),
                "peak_tflops": peak_tflops if peak_tflops is not None else float("nan"),
                "error": timing.error,
            }
        )
    return pd.DataFrame(rows)


def _recomputes_forward(model: torch.nn.Module) -> bool:
    """Whether the model recomputes its forward in the backward (gradient checkpointing)."""
    from probes.step.changes import is_checkpointing

    return is_checkpointing(model.get_base_model() if hasattr(model, "get_base_model") else model)


def run_flop_control(
    runner: StepRunner,
    settings: Settings,
    length: int,
    loss_share: float,
    vocab_size: int,
    flop_model: FlopModel,
) -> dict[str, Any]:
    """Count one real step's FLOPs (harness compute_loss + backward) with FlopCounterMode and
    check the analytic count of the MFU convention against it."""
    generator = torch.Generator().manual_seed(settings.seed + 4)
    batch = bt.to_device(
        bt.uniform_batch(settings.micro_batch, length, loss_share, vocab_size, generator),
        settings.device,
    )
    analytic = flop_model.step_flops(batch)

    def step(batch: dict[str, Any] = batch) -> None:
        runner.forward_backward(batch)

    counter_error = None
    try:
        counted = fl.count_flops_by_op(step)
    except (RuntimeError, AssertionError) as error:  # e.g. a counter formula refusing a shape
        LOG.error("FLOP control: FlopCounterMode failed: %s", error)
        counted, counter_error = {}, f"{type(error).__name__}: {error}"
    finally:
        runner.zero_grad()
    del batch
    release_memory(settings.device)
    control = fl.flop_counter_control(
        analytic,
        counted,
        old_six_n_flops=flop_model.dense_6n_flops(analytic.n_tokens, analytic.attention),
        shape={"batch": settings.micro_batch, "seq_len": length},
        recomputed_forward=_recomputes_forward(runner.model),
        counter_error=counter_error,
    )
    LOG.info(
        "FLOP control at %d x %d: analytic / counted linear FLOPs %.3f (%s)",
        settings.micro_batch,
        length,
        control["observed"]["analytic_over_counted"],
        "passed" if control["passed"] else "FAILED",
    )
    return control


def add_fit_columns(scaling: pd.DataFrame, fit: QuadraticFit) -> pd.DataFrame:
    shares = [
        term_shares(fit, row.seq_len, row.time_s if row.status == OK else float("nan"))
        for row in scaling.itertuples()
    ]
    return pd.concat([scaling, pd.DataFrame(shares, index=scaling.index)], axis=1)


def fit_frame(fit: QuadraticFit, scaling: pd.DataFrame) -> pd.DataFrame:
    row = fit.as_row()
    not_ok = scaling.loc[scaling["status"] != OK, ["seq_len", "status"]]
    dropped = [f"{int(r.seq_len)}:{r.status}" for r in not_ok.itertuples()]
    if dropped:
        row["message"] = f"{row['message']}; not fitted: {', '.join(dropped)}"
    row["dropped_points"] = dropped
    return pd.DataFrame([row])


def run_kernel_profile(
    runner: StepRunner,
    settings: Settings,
    length: int,
    loss_share: float,
    vocab_size: int,
    tolerance: float,
    has_experts: bool = False,
) -> tuple[pd.DataFrame, str, dict[str, Any]]:
    """torch.profiler over a few steps; the category table, the raw text, the double-count check."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(settings.seed + 3)
    batch = bt.to_device(
        bt.uniform_batch(settings.micro_batch, length, loss_share, vocab_size, generator),
        settings.device,
    )
    runner.step([batch])  # one unprofiled warm-up at this shape
    synchronize(settings.device)  # none of its kernels may run inside the profiled window
    activities = [ProfilerActivity.CPU]
    if settings.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        begin = time.perf_counter()
        for _ in range(settings.kernel_steps):
            runner.step([batch])
        synchronize(settings.device)
        wall_s = time.perf_counter() - begin
    del batch
    averages = prof.key_averages()
    rows = kn.rows_from_key_averages(averages, kn.device_event_kinds(prof))
    summed = kn.summed_rows(rows, settings.device.type)
    table = kn.category_table(summed, wall_s, has_experts=has_experts)
    kernel_sum_s = float(table["device_time_s"].sum())
    naive_s = kn.aten_device_time_us(averages) / 1e6 if settings.device.type == "cuda" else None
    excluded = kn.excluded_annotations(rows, settings.device.type)
    check = kn.double_count_check(kernel_sum_s, wall_s, naive_s, tolerance, excluded)
    basis = (
        "self device time of kernel, memcpy and memset events (no ops, no annotations)"
        if settings.device.type == "cuda"
        else "self CPU time of ATen op rows (CPU-only run: no device kernels; no annotations)"
    )
    table["seq_len"] = length
    table["batch"] = settings.micro_batch
    table["steps"] = settings.kernel_steps
    table["wall_s"] = wall_s
    table["kernel_sum_s"] = kernel_sum_s
    table["time_basis"] = basis
    sort_key = "self_cpu_time_total"
    if settings.device.type == "cuda":  # older torch names it self_cuda_time_total
        sort_key = (
            "self_device_time_total"
            if len(averages) and hasattr(averages[0], "self_device_time_total")
            else "self_cuda_time_total"
        )
    header = kn.raw_table_header(
        settings.device.type, settings.kernel_steps, length, settings.micro_batch, wall_s
    )
    raw = header + averages.table(sort_by=sort_key, row_limit=-1, max_name_column_width=100)
    kernel_list = "\n".join(
        f"{r.self_time_us / 1e3:12.3f} ms {r.count:7d}x {r.kind:7s} "
        f"{kn.categorise_kernel(r.name, has_experts):22s} {r.name}"
        for r in sorted(summed, key=lambda r: -r.self_time_us)
    )
    raw += (
        f"\n=== the {len(summed)} summed rows ({basis}), "
        f"sum {kernel_sum_s:.4f} s of wall {wall_s:.4f} s; left out: "
        f"{excluded['annotation_rows_excluded']} annotation row(s), "
        f"{excluded['annotation_time_excluded_s']:.4f} s ===\n{kernel_list}\n"
    )
    release_memory(settings.device)
    return table, raw, check
