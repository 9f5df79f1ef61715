"""The profile stage: time real training steps of the real model through the user's harness.

Order of work: fit control (cheap, fails fast) -> idle-card check -> load weights -> harness
adapters -> scaling points -> fit -> padding penalty -> CE wall clock -> kernel table -> the
double-count control -> outputs (all written only once everything succeeded).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from probes import batches as bt
from probes import flops as fl
from probes import kernels as kn
from probes.ce import full_logits_cross_entropy
from probes.cluster import slurm_environment
from probes.contracts import STAGE_OUTPUTS
from probes.errors import ProbeError
from probes.fit import QuadraticFit, fit_control, fit_step_time, term_shares
from probes.gpu_guard import IdleLimits, probe_card, wait_for_idle_card
from probes.harness import Harness, load_harness
from probes.io import read_json, run_metadata
from probes.lengths import LengthsError, read_training_lengths
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.timing import OK, Timing, release_memory, synchronize, time_repeats

LOG = logging.getLogger("probes.profile")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["profile"])
SKIPPED = "SKIPPED"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ProfileError(ProbeError, RuntimeError):
    """The stage cannot run as configured, or one of its controls failed."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    device: torch.device
    cpu_only: bool
    dtype: torch.dtype
    lengths: list[int]
    warmup: int
    repeats: int
    kernel_steps: int
    probe_length: int | None
    micro_batch: int
    max_seq_len: int
    seed: int


def resolve_device(requested: str, allow_cpu: bool) -> torch.device:
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise ProfileError(
            "profile.device is 'cuda' but torch sees no CUDA device; run on a GPU node or set "
            "profile.device: auto (CPU fallback needs profile.allow_cpu: true)."
        )
    if requested == "cuda" or (requested == "auto" and cuda):
        return torch.device("cuda", 0)
    if not allow_cpu:
        raise ProfileError(
            "no CUDA device and profile.allow_cpu is false; the profile needs a GPU here "
            "(set profile.allow_cpu: true to time small lengths on CPU and say so)."
        )
    return torch.device("cpu")


def resolve_settings(profile: Mapping[str, Any], training: Mapping[str, Any]) -> Settings:
    device = resolve_device(profile["device"], profile["allow_cpu"])
    per_device = profile["cuda" if device.type == "cuda" else "cpu"]
    lengths = sorted({int(v) for v in per_device["lengths"]})
    if len(lengths) < 3:
        raise ProfileError(
            f"profile.{device.type}.lengths: {lengths} has {len(lengths)} distinct length(s); the "
            "scaling fit t(T)=aT^2+bT+c needs at least 3."
        )
    dtype = torch.bfloat16 if profile["dtype"] == "auto" else DTYPES[profile["dtype"]]
    return Settings(
        device=device,
        cpu_only=device.type != "cuda",
        dtype=dtype,
        lengths=lengths,
        warmup=int(per_device["warmup"]),
        repeats=int(per_device["repeats"]),
        kernel_steps=int(per_device["kernel_steps"]),
        probe_length=per_device.get("probe_length"),
        micro_batch=int(profile.get("micro_batch_size") or training["micro_batch_size"]),
        max_seq_len=int(training["max_seq_len"]),
        seed=int(profile["seed"]),
    )


# ---------------------------------------------------------------------------------------------
# The training step, always through the harness
# ---------------------------------------------------------------------------------------------


class StepRunner:
    """Calls the harness's compute_loss for every micro-batch, backward, one optimizer step."""

    def __init__(self, model: torch.nn.Module, harness: Harness, optimizer, device) -> None:
        self.model = model
        self.harness = harness
        self.optimizer = optimizer
        self.device = device

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        for batch in micro_batches:
            loss = self.harness.compute_loss(self.model, batch)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, micro_batches, warmup: int, repeats: int) -> Timing:
        timing = time_repeats(lambda: self.step(micro_batches), self.device, warmup, repeats)
        if timing.status != OK:  # a step cut short may leave partial gradients behind
            self.optimizer.zero_grad(set_to_none=True)
        return timing


def load_model(model_path: str | Path, settings: Settings, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": settings.dtype, "attn_implementation": attn_implementation}
    if settings.device.type == "cuda":
        kwargs["device_map"] = {"": settings.device.index or 0}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    if settings.device.type != "cuda":
        model.to(settings.device)
    if model.dtype != settings.dtype:  # transformers < 4.56 names the argument torch_dtype
        model.to(settings.dtype)
    model.config.use_cache = False
    return model


def prepare_harness(
    model: torch.nn.Module, harness: Harness, options: dict[str, Any]
) -> tuple[torch.nn.Module, Any, list[str]]:
    """The harness's own target discovery, adapters and optimizer (reference ones as fallback)."""
    from probes import reference_harness

    configure = harness.hook("configure")
    if configure is not None:
        configure(options)
    targets = list(harness.discover_target_modules(model))
    if not targets:
        raise ProfileError(f"harness {harness.spec}: discover_target_modules returned no module")
    apply_adapters = harness.hook("apply_adapters") or reference_harness.apply_adapters
    model = apply_adapters(model, targets)
    model.train()
    build_optimizer = harness.hook("build_optimizer") or reference_harness.build_optimizer
    return model, build_optimizer(model), targets


def _text_config(model: torch.nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.to_dict()


# ---------------------------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------------------------


def run_scaling(
    runner: StepRunner,
    settings: Settings,
    loss_share: float,
    vocab_size: int,
    text_config: Mapping[str, Any],
    active_params: int,
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
        timing = runner.timed([batch], settings.warmup, settings.repeats)
        del batch
        release_memory(settings.device)
        tokens = settings.micro_batch * length
        attention = fl.attention_training_flops(text_config, [length] * settings.micro_batch)
        model_flops = fl.training_step_flops(active_params, tokens, attention)
        frozen_flops = fl.training_step_flops(active_params, tokens, attention, per_param=4)
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
                "model_flops": model_flops,
                "attention_flops": attention,
                "mfu": fl.mfu(model_flops, timing.time_s, peak_tflops),
                "mfu_frozen_base": fl.mfu(frozen_flops, timing.time_s, peak_tflops),
                "peak_tflops": peak_tflops if peak_tflops is not None else float("nan"),
                "error": timing.error,
            }
        )
    return pd.DataFrame(rows)


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


def predicted_padding_penalty(fit: QuadraticFit, pick: bt.PaddingPick, batch: int) -> float:
    """From the fit: t(longest) for the padded batch against the same rows' per-token terms
    (a*L^2 + b*L per row, a and b being per-batch) plus one fixed per-step cost c."""
    if not fit.usable:
        return float("nan")
    padded = fit.predict(pick.longest)
    unpadded = sum(fit.a * n * n + fit.b * n for n in pick.n_tokens) / batch + fit.c
    return padded / unpadded - 1.0 if unpadded > 0 else float("nan")


def run_padding_penalty(
    runner: StepRunner,
    settings: Settings,
    pick: bt.PaddingPick,
    fit: QuadraticFit,
    vocab_size: int,
    pad_id: int,
) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(settings.seed + 1)
    padded = bt.to_device(
        bt.padded_batch(pick.n_tokens, pick.n_loss_tokens, vocab_size, generator, pad_id=pad_id),
        settings.device,
    )
    # the same examples, one micro-batch each (gradient accumulation, one optimizer step)
    singles = [
        {key: value[row : row + 1, :length] for key, value in padded.items()}
        for row, length in enumerate(pick.n_tokens)
    ]
    packed = bt.to_device(
        bt.packed_batch(pick.n_tokens, pick.n_loss_tokens, vocab_size, generator), settings.device
    )
    variants = {"padded": [padded], "one_by_one": singles, "packed": [packed]}
    timings = {}
    for name, micro_batches in tqdm(variants.items(), desc="padding penalty", unit="variant"):
        timings[name] = runner.timed(micro_batches, settings.warmup, settings.repeats)
        LOG.info("padding %s: %s %.4f s", name, timings[name].status, timings[name].time_s)
    del padded, singles, packed
    release_memory(settings.device)
    predicted = predicted_padding_penalty(fit, pick, len(pick.n_tokens))
    padded_t = timings["padded"]
    rows = []
    for name in ("one_by_one", "packed"):
        unpadded_t = timings[name]
        both_ok = padded_t.status == OK and unpadded_t.status == OK
        rows.append(
            {
                "variant": name,
                "status": OK if both_ok else f"padded:{padded_t.status},{name}:{unpadded_t.status}",
                "padded_time_s": padded_t.time_s,
                "unpadded_time_s": unpadded_t.time_s,
                "measured_penalty": (
                    padded_t.time_s / unpadded_t.time_s - 1.0 if both_ok else float("nan")
                ),
                "predicted_penalty": predicted,
                "padded_peak_mem_bytes": padded_t.peak_mem_bytes,
                "unpadded_peak_mem_bytes": unpadded_t.peak_mem_bytes,
                "batch": len(pick.n_tokens),
                "longest": pick.longest,
                "n_real_tokens": pick.n_real_tokens,
                "n_padded_tokens": pick.longest * len(pick.n_tokens),
                "padding_waste": pick.padding_waste,
                "example_ids": pick.example_ids,
                "example_lengths": pick.n_tokens,
                "example_loss_tokens": pick.n_loss_tokens,
                "pick": pick.method,
                "timer": padded_t.timer,
            }
        )
    return pd.DataFrame(rows)


def skipped_penalty(reason: str) -> pd.DataFrame:
    nan = float("nan")
    return pd.DataFrame(
        [
            {
                "variant": "one_by_one",
                "status": SKIPPED,
                "padded_time_s": nan,
                "unpadded_time_s": nan,
                "measured_penalty": nan,
                "predicted_penalty": nan,
                "batch": 0,
                "longest": 0,
                "n_real_tokens": 0,
                "padding_waste": nan,
                "example_ids": [],
                "example_lengths": [],
                "pick": reason,
            }
        ]
    )


def _free_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        return float("inf")


def _time_head_variants(
    variants: Mapping[str, tuple[Callable[[torch.Tensor], torch.Tensor], int | None, str]],
    hidden: torch.Tensor,
    settings: Settings,
    full_logits_bytes: float,
) -> list[tuple[str, Timing, int | None, str]]:
    """Forward + backward of each head + loss variant from a fresh leaf of the hidden states."""
    results = []
    for name, (fn, chunk, source) in variants.items():
        if name == "unchunked" and full_logits_bytes > 0.9 * _free_bytes(settings.device):
            need = full_logits_bytes / 2**30
            timing = Timing(SKIPPED, error=f"needs ~{need:.1f} GiB for the full logits")
        else:

            def once(fn=fn) -> None:
                fn(hidden.detach().requires_grad_(True)).backward()

            timing = time_repeats(once, settings.device, settings.warmup, settings.repeats)
        LOG.info("ce %s: %s %.4f s", name, timing.status, timing.time_s)
        results.append((name, timing, chunk, source))
    return results


def run_ce(
    model: torch.nn.Module,
    harness: Harness,
    settings: Settings,
    length: int,
    step_time_s: float,
    loss_share: float,
    vocab_size: int,
    chunk_tokens: int,
    step_source: str = "measured",
) -> pd.DataFrame:
    """Head + CE forward and backward on the real hidden states of a step at `length`, chunked
    (the harness's own loss_from_hidden, else the reference one) against unchunked logits."""
    from probes import reference_harness

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    generator = torch.Generator().manual_seed(settings.seed + 2)
    batch = bt.to_device(
        bt.uniform_batch(settings.micro_batch, length, loss_share, vocab_size, generator),
        settings.device,
    )
    with torch.no_grad():
        hidden = base.get_decoder()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        )[0]
    labels = batch["labels"]
    head = base.get_output_embeddings()
    softcap = _text_config(model).get("final_logit_softcapping")
    n_loss = int((labels[:, 1:] != -100).sum())
    chunked_fn = harness.hook("loss_from_hidden")
    chunked_source = "harness.loss_from_hidden"
    if chunked_fn is None:
        chunked_fn = reference_harness.loss_from_hidden
        chunked_source = "probes.reference_harness.loss_from_hidden (harness has none)"
    variants = {
        "chunked": (
            lambda h, labels=labels: chunked_fn(model, h, labels),
            chunk_tokens,
            chunked_source,
        ),
        "unchunked": (
            lambda h, labels=labels: full_logits_cross_entropy(h, head, labels, softcap),
            None,
            "probes.ce.full_logits_cross_entropy (stock causal-LM loss: all positions' logits)",
        ),
    }
    # bf16 logits, their fp32 copy, log-softmax and gradient: ~14 bytes per element
    full_bytes = float(settings.micro_batch * length * vocab_size * 14)
    timed = _time_head_variants(variants, hidden, settings, full_bytes)
    del variants, hidden, batch, labels
    release_memory(settings.device)

    common = {"seq_len": length, "batch": settings.micro_batch, "loss_tokens": n_loss}
    rows = [
        {
            "variant": "train_step",
            "status": OK,
            "time_s": step_time_s,
            "step_share": 1.0,
            **common,
            "chunk_tokens": None,
            "peak_mem_bytes": float("nan"),
            "source": (
                f"step time at this length ({step_source}): harness.compute_loss + backward + "
                "optimizer step"
            ),
        }
    ]
    for name, timing, chunk, source in timed:
        rows.append(
            {
                "variant": name,
                "status": timing.status,
                "time_s": timing.time_s,
                "step_share": timing.time_s / step_time_s if timing.status == OK else float("nan"),
                **common,
                "chunk_tokens": chunk,
                "peak_mem_bytes": timing.peak_mem_bytes,
                "source": source + (f"; {timing.error}" if timing.error else ""),
            }
        )
    frame = pd.DataFrame(rows)
    frame["chunk_tokens"] = frame["chunk_tokens"].astype("Int64")
    return frame


def run_kernel_profile(
    runner: StepRunner,
    settings: Settings,
    length: int,
    loss_share: float,
    vocab_size: int,
    tolerance: float,
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
    rows = kn.rows_from_key_averages(averages)
    summed = kn.summed_rows(rows, settings.device.type)
    table = kn.category_table(summed, wall_s)
    kernel_sum_s = float(table["device_time_s"].sum())
    naive_s = kn.aten_device_time_us(averages) / 1e6 if settings.device.type == "cuda" else None
    check = kn.double_count_check(kernel_sum_s, wall_s, naive_s, tolerance)
    basis = (
        "self device time of CUDA kernel rows"
        if settings.device.type == "cuda"
        else "self CPU time of op rows (CPU-only run: no device kernels)"
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
        f"{r.self_time_us / 1e3:12.3f} ms {r.count:7d}x {kn.categorise_kernel(r.name):22s} {r.name}"
        for r in sorted(summed, key=lambda r: -r.self_time_us)
    )
    raw += (
        f"\n=== the {len(summed)} summed rows ({basis}), "
        f"sum {kernel_sum_s:.4f} s of wall {wall_s:.4f} s ===\n{kernel_list}\n"
    )
    release_memory(settings.device)
    return table, raw, check


# ---------------------------------------------------------------------------------------------
# Provenance and the evidence text
# ---------------------------------------------------------------------------------------------


def device_description(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_total_bytes": int(props.total_memory),
            "device_count": torch.cuda.device_count(),
            "cuda_runtime": torch.version.cuda,
        }
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "type": "cpu",
        "name": name,
        "capability": None,
        "memory_total_bytes": None,
        "threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _read_recommendation(path: str | Path | None) -> dict[str, Any] | None:
    if not path or not Path(path).is_file():
        return None
    try:
        rec = read_json(path)
    except ValueError:
        LOG.warning("%s: not valid JSON; ignored (informational only)", path)
        return None
    if not isinstance(rec, dict):
        return None

    def scalar(value: Any) -> bool:
        return isinstance(value, (int, float, str, bool)) or value is None

    # informational: top-level scalars and one level of scalar-only objects (e.g. batch shapes)
    return {
        key: value
        for key, value in rec.items()
        if scalar(value) or (isinstance(value, dict) and all(scalar(v) for v in value.values()))
    }


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def evidence_text(
    provenance: dict[str, Any],
    scaling: pd.DataFrame,
    fit: QuadraticFit,
    penalty: pd.DataFrame,
    ce: pd.DataFrame,
    kernels: pd.DataFrame,
    raw_table: str,
    controls: list[dict[str, Any]],
) -> str:
    """profile-output.txt: the run's raw evidence, numbers only (no data text ever)."""
    device = provenance["device"]
    lines = [
        "# probes profile: raw evidence",
        f"device: {device['name']} ({device['type']})"
        + (" CPU-ONLY RUN" if provenance["cpu_only"] else ""),
        f"harness: {provenance['harness']['spec']} -> {provenance['harness']['functions']}",
        f"dtype {provenance['dtype']}, attention {provenance['attn_implementation']}, "
        f"micro-batch {provenance['micro_batch_size']}, active params "
        f"{provenance['params']['active_params']:,}, trainable {provenance['trainable_params']:,}",
        f"date {provenance['run']['date']}, commit {provenance['run']['git_commit']}",
        "",
        "## scaling (time = median of repeats, forward + backward + optimizer step)",
    ]
    for r in scaling.itertuples():
        lines.append(
            f"  {r.batch} x {r.seq_len:6d}: {r.status:3s} t={_fmt(r.time_s)} s "
            f"(std {_fmt(r.time_std_s)}), peak {_fmt(r.peak_mem_bytes / 2**30, '.2f')} GiB, "
            f"quadratic share {_fmt(r.quadratic_share, '.3f')}, MFU {_fmt(r.mfu, '.3f')}"
        )
    lines += [
        "",
        f"## fit t(T) = a T^2 + b T + c ({fit.method}, {fit.n_points} points)",
        f"  a={_fmt(fit.a)} s/token^2  b={_fmt(fit.b)} s/token  c={_fmt(fit.c)} s",
        f"  condition number (column-scaled) {_fmt(fit.condition_number)}, residual rms "
        f"{_fmt(fit.residual_rms_s)} s, max relative residual {_fmt(fit.max_rel_residual)}",
        f"  {fit.message}",
        "",
        "## padding penalty (same examples, ids only)",
    ]
    for r in penalty.itertuples():
        lines.append(
            f"  padded {_fmt(r.padded_time_s)} s vs {r.variant} {_fmt(r.unpadded_time_s)} s: "
            f"measured penalty {_fmt(r.measured_penalty, '.3f')}, fit-predicted "
            f"{_fmt(r.predicted_penalty, '.3f')} (lengths {r.example_lengths}, longest "
            f"{r.longest}, waste {_fmt(r.padding_waste, '.3f')})"
        )
    if len(penalty):
        lines.append(
            f"  example ids {list(penalty['example_ids'].iloc[0])}; {penalty['pick'].iloc[0]}"
        )
    lines += ["", "## LM head + cross-entropy (forward + backward on real hidden states)"]
    for r in ce.itertuples():
        lines.append(
            f"  {r.variant:10s} {r.status:7s} t={_fmt(r.time_s)} s, share of step "
            f"{_fmt(r.step_share, '.3f')}, chunk "
            f"{r.chunk_tokens if pd.notna(r.chunk_tokens) else '-'}, peak "
            f"{_fmt(r.peak_mem_bytes / 2**30, '.2f')} GiB [{r.source}]"
        )
    lines += ["", "## kernel categories"]
    for r in kernels.itertuples():
        lines.append(
            f"  {r.category:22s} {r.device_time_s:10.4f} s  share {r.share:.3f}  "
            f"of wall {r.share_of_wall:.3f}  ({r.n_kernels} kernels)"
        )
    lines += ["", "## controls"]
    for control in controls:
        lines.append(f"  {control['name']}: {'PASSED' if control['passed'] else 'FAILED'}")
    lines += ["", raw_table]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def run_profile(
    lengths_path: str | Path,
    recommendation_path: str | Path | None,
    model_path: str | Path,
    outputs: Mapping[str, str | Path],
    config: Mapping[str, Any],
    card_probe: Callable[[int], Any] = probe_card,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run every probe and write every output (or none). Returns a summary for the log."""
    missing = [key for key in OUTPUT_KEYS if key not in outputs]
    if missing:
        raise ProfileError(f"profile outputs missing path(s) for {missing}")
    profile, training = config["profile"], config["training"]
    settings = resolve_settings(profile, training)
    LOG.info(
        "device %s%s, lengths %s, micro-batch %d",
        settings.device,
        " (CPU-only: small lengths, no device kernels)" if settings.cpu_only else "",
        settings.lengths,
        settings.micro_batch,
    )

    # the fit's positive control first: cheap, and a broken fit must not cost a GPU run
    controls = [fit_control(settings.lengths)]
    if not controls[0]["passed"]:
        raise ProfileError(f"positive control failed: {controls[0]}")

    train = read_training_lengths(lengths_path, settings.max_seq_len)
    # which tokens carry loss (training.loss_on): the padding stage counted them per example
    if profile.get("loss_fraction") is not None:
        loss_share, loss_source = float(profile["loss_fraction"]), "config profile.loss_fraction"
    elif training.get("loss_on", "assistant") == "all":
        loss_share, loss_source = 1.0, "training.loss_on: all"
    else:
        loss_share = bt.loss_fraction(train)
        loss_source = "n_loss_tokens / n_tokens of the padding lengths (training.loss_on)"
    # fail before loading weights if no micro-batch fits the longest length at all
    bt.pick_padding_batch(
        train, settings.micro_batch, max(settings.lengths), settings.seed, profile["padding_draws"]
    )
    harness = load_harness(profile["harness"])

    idle: dict[str, Any] = {"checked": False, "reason": "CPU run: no card to check"}
    if settings.device.type == "cuda":
        idle_cfg = profile["idle"]
        limits = IdleLimits(
            idle_cfg["max_memory_used_mib"],
            idle_cfg["max_utilization_pct"],
            idle_cfg["allow_other_processes"],
        )
        state, polls = wait_for_idle_card(
            lambda: card_probe(settings.device.index or 0),
            limits,
            idle_cfg["timeout_s"],
            idle_cfg["initial_backoff_s"],
            idle_cfg["max_backoff_s"],
            sleep=sleep,
        )
        idle = {"checked": True, "polls": polls, "state": state.as_dict(), "limits": vars(limits)}

    if settings.cpu_only:
        torch.set_num_threads(int(profile["cpu"]["threads"]))
    torch.manual_seed(settings.seed)
    model = load_model(model_path, settings, profile["attn_implementation"])
    params = fl.model_active_parameters(model)
    text_config = _text_config(model)
    vocab_size = int(text_config["vocab_size"])
    pad_id = int(text_config.get("pad_token_id") or 0)
    options = {"ce_chunk_tokens": int(profile["ce_chunk_tokens"]), **profile["harness_options"]}
    model, optimizer, targets = prepare_harness(model, harness, options)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    runner = StepRunner(model, harness, optimizer, settings.device)
    device_info = device_description(settings.device)
    peak = profile.get("peak_tflops")
    peak_source = "config profile.peak_tflops"
    if peak is None:
        peak = fl.peak_tflops_for(device_info["name"]) if not settings.cpu_only else None
        peak_source = (
            f"bf16 dense peak for '{device_info['name']}'"
            if peak is not None
            else "unknown for this device: MFU is NaN (set profile.peak_tflops)"
        )
    LOG.info(
        "harness %s: %d target modules, %d trainable params; active params %d",
        harness.spec,
        len(targets),
        trainable,
        params["active_params"],
    )

    scaling = run_scaling(
        runner, settings, loss_share, vocab_size, text_config, params["active_params"], peak
    )
    ok = scaling[scaling["status"] == OK]
    fit = fit_step_time(ok["seq_len"].tolist(), ok["time_s"].tolist())
    LOG.info("fit: %s (%s)", fit.method, fit.message)
    scaling = add_fit_columns(scaling, fit)
    if ok.empty:
        raise ProfileError(
            f"every scaling point failed ({scaling['status'].tolist()} at {settings.lengths}); "
            "lower profile lengths or the micro-batch size."
        )

    # the padding batch stays within the lengths that ran, so the fit interpolates it
    try:
        pick = bt.pick_padding_batch(
            train,
            settings.micro_batch,
            int(ok["seq_len"].max()),
            settings.seed,
            profile["padding_draws"],
            profile["padding_waste_quantile"],
        )
        penalty = run_padding_penalty(runner, settings, pick, fit, vocab_size, pad_id)
    except LengthsError as error:
        LOG.warning("padding penalty skipped: %s", error)
        penalty = skipped_penalty(str(error))
    # CE and kernel probes at one length: the longest on a GPU (where attention and the head
    # weigh most), the shortest on CPU (to keep the fallback run short)
    probe_length = settings.probe_length or int(
        ok["seq_len"].max() if settings.device.type == "cuda" else ok["seq_len"].min()
    )
    ok_lengths = set(ok["seq_len"])
    step_at_probe = (
        float(ok.loc[ok["seq_len"] == probe_length, "time_s"].iloc[0])
        if probe_length in ok_lengths
        else fit.predict(probe_length)
    )
    ce = run_ce(
        model,
        harness,
        settings,
        probe_length,
        step_at_probe,
        loss_share,
        vocab_size,
        int(profile["ce_chunk_tokens"]),
        "measured" if probe_length in ok_lengths else "predicted by the fit",
    )
    kernels, raw_table, check = run_kernel_profile(
        runner, settings, probe_length, loss_share, vocab_size, profile["double_count_tolerance"]
    )
    controls.append(check)

    run = run_metadata(dict(config))
    provenance = {
        "device": device_info,
        "cpu_only": settings.cpu_only,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "attn_implementation": profile["attn_implementation"],
        "lengths": settings.lengths,
        "warmup": settings.warmup,
        "repeats": settings.repeats,
        "kernel_steps": settings.kernel_steps,
        "probe_length": probe_length,
        "probe_step_time_source": "measured" if probe_length in ok_lengths else "fit",
        "micro_batch_size": settings.micro_batch,
        "loss_fraction": loss_share,
        "loss_fraction_source": loss_source,
        "model_path": str(model_path),
        "params": params,
        "trainable_params": int(trainable),
        "peak_tflops": peak,
        "peak_tflops_source": peak_source,
        "harness": {**harness.describe(), "target_modules": targets, "options": options},
        "idle_check": idle,
        "slurm": slurm_environment(),
        "bucket_recommendation": _read_recommendation(recommendation_path),
        "versions": run["versions"],
        "run": run,
    }
    passed = all(c["passed"] for c in controls)
    control = {
        "name": "profile_controls",
        "description": "the scaling fit recovers known coefficients; kernel sum <= profiled wall",
        "expected": {c["name"]: c["expected"] for c in controls},
        "observed": {c["name"]: c["observed"] for c in controls},
        "passed": passed,
        "checks": controls,
    }
    if not passed:
        failed = [c["name"] for c in controls if not c["passed"]]
        raise ProfileError(f"control(s) failed: {failed}: {[c['observed'] for c in controls]}")

    text = evidence_text(provenance, scaling, fit, penalty, ce, kernels, raw_table, controls)
    with all_or_nothing(outputs) as out:
        out.parquet("scaling", scaling, run)
        out.parquet("fit", fit_frame(fit, scaling), run)
        out.parquet("padding_penalty", penalty, run)
        out.parquet("ce", ce, run)
        out.parquet("kernels", kernels, run)
        out.text("raw", text)
        out.json("provenance", provenance)
        out.json("control", control)
    return {
        "device": device_info["name"],
        "cpu_only": settings.cpu_only,
        "scaling": scaling[["seq_len", "status", "time_s", "mfu"]].to_dict("records"),
        "fit": {"a": fit.a, "b": fit.b, "c": fit.c, "method": fit.method},
        "padding_penalty": penalty[["variant", "measured_penalty", "predicted_penalty"]].to_dict(
            "records"
        ),
        "ce": ce[["variant", "status", "time_s", "step_share"]].to_dict("records"),
        "kernel_sum_s": float(kernels["device_time_s"].sum()),
        "kernel_wall_s": float(kernels["wall_s"].iloc[0]) if len(kernels) else float("nan"),
    }


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_profile(
        inputs["lengths"],
        inputs.get("recommendation"),
        Path(inputs["tokenizer"][0]).parent,
        outputs,
        cfg.raw,
    )
    LOG.info("profile summary: %s", summary)
