"""The profile stage: time real training steps of the real model through the user's harness.

Order of work: fit control (cheap, fails fast) -> idle-card check -> load weights -> harness
adapters -> scaling points -> fit -> FLOP-count control (FlopCounterMode on one real step) ->
padding penalty -> CE wall clock -> kernel table -> the double-count control -> outputs (all
written only once everything succeeded). MFU follows probes.flops.MFU_CONVENTION.
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
from probes.ce import full_logits_cross_entropy, loss_positions_cross_entropy
from probes.cluster import slurm_environment
from probes.contracts import STAGE_OUTPUTS
from probes.dtype_choice import resolve_dtype
from probes.errors import ProbeError
from probes.fit import QuadraticFit, fit_control, fit_step_time, term_shares
from probes.gpu_guard import IdleLimits, probe_card, wait_for_idle_card
from probes.harness import Harness, load_harness, qualified_name
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
    dtype_reason: str  # why this dtype: probes.dtype_choice.choose_dtype
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
    dtype_name, dtype_reason = resolve_dtype(profile["dtype"], device.type)
    return Settings(
        device=device,
        cpu_only=device.type != "cuda",
        dtype=DTYPES[dtype_name],
        dtype_reason=dtype_reason,
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


@dataclass(frozen=True)
class FlopModel:
    """What the MFU convention needs about the model as it trains (see probes.flops)."""

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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(type(base), name, None)
        if value is not None:
            return bool(getattr(base, name))
    return False


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
        runner.harness.compute_loss(runner.model, batch).backward()

    counter_error = None
    try:
        counted = fl.count_flops_by_op(step)
    except (RuntimeError, AssertionError) as error:  # e.g. a counter formula refusing a shape
        LOG.error("FLOP control: FlopCounterMode failed: %s", error)
        counted, counter_error = {}, f"{type(error).__name__}: {error}"
    finally:
        runner.optimizer.zero_grad(set_to_none=True)
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


PENALTY_VARIANTS = ("one_by_one", "packed")
PREDICTION_BASIS = {
    "one_by_one": (
        "fit read per row: each row its own micro-batch, so one fixed cost c per row "
        "(sum (a n^2 + b n)/B + c)"
    ),
    "packed": (
        "fit read per row: one row of sum(n) tokens whose dense attention costs (sum n)^2, "
        "one fixed cost ((a S^2 + b S)/B + c)"
    ),
}


def predicted_penalties(
    fit: QuadraticFit, pick: bt.PaddingPick, fit_batch: int
) -> dict[str, tuple[float, float, float, str]]:
    """Per variant (padded time, unpadded time, penalty, basis) predicted by the fit, or NaN
    with the reason: no usable fit, or a row longer than the longest fitted length (the packed
    row of sum(n) tokens often is) -- the fit is never used above the range it was measured on.
    Rows shorter than the shortest fitted length are read toward T=0, where c dominates; the
    basis says so."""
    nan = float("nan")
    if not fit.usable:
        return {name: (nan, nan, nan, f"none: {fit.message}") for name in PENALTY_VARIANTS}
    times = bt.predicted_step_times(fit.a, fit.b, fit.c, fit_batch, pick.n_tokens)
    top = max(fit.lengths) if fit.lengths else float("inf")
    bottom = min(fit.lengths) if fit.lengths else 0
    needed = {"one_by_one": pick.longest, "packed": pick.n_real_tokens}
    out = {}
    for name in PENALTY_VARIANTS:
        if needed[name] > top:
            reason = f"none: a {needed[name]}-token row is beyond the longest fitted length {top}"
            out[name] = (times["padded"], nan, nan, reason)
            continue
        if times[name] <= 0 or times["padded"] <= 0:
            out[name] = (nan, nan, nan, "none: the fit predicts a non-positive step time here")
            continue
        basis = PREDICTION_BASIS[name]
        if min(pick.n_tokens) < bottom:
            basis += f"; rows below the shortest fitted length {bottom} read toward T=0"
        out[name] = (times["padded"], times[name], times["padded"] / times[name] - 1.0, basis)
    return out


def _time_padding_variants(
    runner: StepRunner,
    settings: Settings,
    pick: bt.PaddingPick,
    vocab_size: int,
    pad_id: int,
    seed: int,
) -> dict[str, Timing]:
    generator = torch.Generator().manual_seed(seed)
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
    for name, micro_batches in variants.items():
        timings[name] = runner.timed(micro_batches, settings.warmup, settings.repeats)
        LOG.info("padding %s: %s %.4f s", name, timings[name].status, timings[name].time_s)
    del padded, singles, packed, variants
    release_memory(settings.device)
    return timings


def _median(values: list[float]) -> float:
    finite = [v for v in values if isinstance(v, float) and math.isfinite(v)]
    return float(pd.Series(finite).median()) if finite else float("nan")


def _spread(values: list[float]) -> tuple[float, float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan"), float("nan")
    return min(finite), _median(finite), max(finite)


def run_padding_penalty(
    runner: StepRunner,
    settings: Settings,
    picks: list[bt.PaddingPick],
    fit: QuadraticFit,
    vocab_size: int,
    pad_id: int,
) -> pd.DataFrame:
    """Each picked batch padded, one by one and packed; one row per unpadded variant with the
    penalty's spread over the batches (min / median / max) and the fit's prediction."""
    per_batch = [
        _time_padding_variants(runner, settings, pick, vocab_size, pad_id, settings.seed + 1 + i)
        for i, pick in enumerate(tqdm(picks, desc="padding penalty", unit="batch"))
    ]
    predictions = [predicted_penalties(fit, pick, settings.micro_batch) for pick in picks]
    rows = []
    for name in PENALTY_VARIANTS:
        padded_times, unpadded_times, measured, statuses = [], [], [], []
        for timings in per_batch:
            padded_t, unpadded_t = timings["padded"], timings[name]
            both_ok = padded_t.status == OK and unpadded_t.status == OK
            failed = f"padded:{padded_t.status},{name}:{unpadded_t.status}"
            statuses.append(OK if both_ok else failed)
            padded_times.append(padded_t.time_s)
            unpadded_times.append(unpadded_t.time_s)
            measured.append(padded_t.time_s / unpadded_t.time_s - 1.0 if both_ok else float("nan"))
        low, middle, high = _spread(measured)
        predicted = [p[name][2] for p in predictions]
        n_ok = statuses.count(OK)
        rows.append(
            {
                "variant": name,
                "status": OK if n_ok == len(statuses) else "; ".join(sorted(set(statuses))),
                "n_batches": len(picks),
                "n_batches_ok": n_ok,
                "padded_time_s": _median(padded_times),
                "unpadded_time_s": _median(unpadded_times),
                "measured_penalty": middle,
                "measured_penalty_min": low,
                "measured_penalty_max": high,
                "predicted_padded_time_s": _median([p[name][0] for p in predictions]),
                "predicted_unpadded_time_s": _median([p[name][1] for p in predictions]),
                "predicted_penalty": _median(predicted),
                "prediction": "; ".join(sorted({p[name][3] for p in predictions})),
                "padded_peak_mem_bytes": max(t["padded"].peak_mem_bytes for t in per_batch),
                "unpadded_peak_mem_bytes": max(t[name].peak_mem_bytes for t in per_batch),
                "batch": settings.micro_batch,
                "longest": max(p.longest for p in picks),
                "n_real_tokens": _median([float(p.n_real_tokens) for p in picks]),
                "padding_waste": _median([p.padding_waste for p in picks]),
                "batch_padded_time_s": padded_times,
                "batch_unpadded_time_s": unpadded_times,
                "batch_measured_penalty": measured,
                "batch_predicted_penalty": predicted,
                "batch_padding_waste": [p.padding_waste for p in picks],
                "batch_example_ids": [p.example_ids for p in picks],
                "batch_example_lengths": [p.n_tokens for p in picks],
                "batch_example_loss_tokens": [p.n_loss_tokens for p in picks],
                "repeats_per_batch": settings.repeats,
                "pick": picks[0].method,
                "timer": per_batch[0]["padded"].timer,
            }
        )
    return pd.DataFrame(rows)


def skipped_penalty(reason: str) -> pd.DataFrame:
    nan = float("nan")
    return pd.DataFrame(
        [
            {
                "variant": name,
                "status": SKIPPED,
                "n_batches": 0,
                "n_batches_ok": 0,
                "padded_time_s": nan,
                "unpadded_time_s": nan,
                "measured_penalty": nan,
                "measured_penalty_min": nan,
                "measured_penalty_max": nan,
                "predicted_penalty": nan,
                "prediction": "none: no batch was timed",
                "batch": 0,
                "longest": 0,
                "n_real_tokens": 0.0,
                "padding_waste": nan,
                "pick": reason,
            }
            for name in PENALTY_VARIANTS
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


@dataclass(frozen=True)
class HeadVariant:
    """One way of running the LM head + loss on the hidden states of a step."""

    loss: Callable[[torch.Tensor], torch.Tensor]
    positions: str  # "all" | "loss": which positions' logits it computes
    n_positions: int
    chunk_tokens: int | None  # None: the logits of all its positions at once
    source: str  # the loss function timed


def _time_head_variants(
    variants: Mapping[str, HeadVariant], hidden: torch.Tensor, settings: Settings, vocab: int
) -> list[tuple[str, Timing]]:
    """Forward + backward of each head + loss variant from a fresh leaf of the hidden states."""
    results = []
    for name, variant in variants.items():
        # an unchunked variant holds its logits: bf16, an fp32 copy, log-softmax, gradient
        need = float(variant.n_positions * vocab * 14) if variant.chunk_tokens is None else 0.0
        if need > 0.9 * _free_bytes(settings.device):
            timing = Timing(SKIPPED, error=f"needs ~{need / 2**30:.1f} GiB for its logits")
        else:

            def once(fn=variant.loss) -> None:
                fn(hidden.detach().requires_grad_(True)).backward()

            timing = time_repeats(once, settings.device, settings.warmup, settings.repeats)
        LOG.info("ce %s: %s %.4f s", name, timing.status, timing.time_s)
        results.append((name, timing))
    return results


def head_variants(
    model: torch.nn.Module,
    harness: Harness,
    labels: torch.Tensor,
    chunk_tokens: int,
) -> dict[str, HeadVariant]:
    """All positions unchunked (the stock loss), loss positions unchunked (position selection
    alone), loss positions chunked (the harness's own loss_from_hidden, else the reference's):
    consecutive rows differ in one change each."""
    from probes import reference_harness

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    softcap = _text_config(model).get("final_logit_softcapping")
    n_loss = bt.loss_position_count(labels)
    chunked_fn = harness.hook("loss_from_hidden")
    if chunked_fn is not None:
        chunked_source = f"harness.loss_from_hidden ({qualified_name(chunked_fn)})"
    else:
        chunked_fn = reference_harness.loss_from_hidden
        chunked_source = (
            "probes.reference_harness.loss_from_hidden (harness has none): chunked fused "
            "linear cross-entropy"
        )
    return {
        "all_positions_unchunked": HeadVariant(
            lambda h: full_logits_cross_entropy(h, head, labels, softcap),
            "all",
            int(labels.numel()),
            None,
            "probes.ce.full_logits_cross_entropy (stock causal-LM loss: every position's logits)",
        ),
        "loss_positions_unchunked": HeadVariant(
            lambda h: loss_positions_cross_entropy(h, head, labels, softcap),
            "loss",
            n_loss,
            None,
            "probes.ce.loss_positions_cross_entropy (stock loss on the loss positions' logits)",
        ),
        "loss_positions_chunked": HeadVariant(
            lambda h: chunked_fn(model, h, labels), "loss", n_loss, chunk_tokens, chunked_source
        ),
    }


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
    """Head + CE forward and backward on the real hidden states of a step at `length`, in the
    three variants of head_variants, beside the step they belong to."""
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
    variants = head_variants(model, harness, labels, chunk_tokens)
    timed = _time_head_variants(variants, hidden, settings, vocab_size)
    n_loss = bt.loss_position_count(labels)
    del hidden, batch, labels
    release_memory(settings.device)

    common = {"seq_len": length, "batch": settings.micro_batch, "loss_tokens": n_loss}
    rows = [
        {
            "variant": "train_step",
            "status": OK,
            "time_s": step_time_s,
            "step_share": 1.0,
            **common,
            "positions": None,
            "n_positions": None,
            "chunk_tokens": None,
            "peak_mem_bytes": float("nan"),
            "source": (
                f"step time at this length ({step_source}): harness.compute_loss + backward + "
                "optimizer step"
            ),
        }
    ]
    for name, timing in timed:
        variant = variants[name]
        rows.append(
            {
                "variant": name,
                "status": timing.status,
                "time_s": timing.time_s,
                "step_share": timing.time_s / step_time_s if timing.status == OK else float("nan"),
                **common,
                "positions": variant.positions,
                "n_positions": variant.n_positions,
                "chunk_tokens": variant.chunk_tokens,
                "peak_mem_bytes": timing.peak_mem_bytes,
                "source": variant.source + (f"; {timing.error}" if timing.error else ""),
            }
        )
    frame = pd.DataFrame(rows)
    frame["chunk_tokens"] = frame["chunk_tokens"].astype("Int64")
    frame["n_positions"] = frame["n_positions"].astype("Int64")
    return frame


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
            f"quadratic share {_fmt(r.quadratic_share, '.3f')}, MFU {_fmt(r.mfu, '.3f')} "
            f"(dense 6N reading {_fmt(r.mfu_dense_6n, '.3f')})"
        )
    lines += [
        "",
        f"## fit t(T) = a T^2 + b T + c ({fit.method}, {fit.n_points} points)",
        f"  a={_fmt(fit.a)} s/token^2  b={_fmt(fit.b)} s/token  c={_fmt(fit.c)} s",
        f"  condition number (column-scaled) {_fmt(fit.condition_number)}, residual rms "
        f"{_fmt(fit.residual_rms_s)} s, max relative residual {_fmt(fit.max_rel_residual)}",
        f"  {fit.message}",
        "",
        "## padding penalty (same examples, ids only; medians over the batches, spread min-max)",
    ]
    for r in penalty.itertuples():
        lines.append(
            f"  padded {_fmt(r.padded_time_s)} s vs {r.variant} {_fmt(r.unpadded_time_s)} s: "
            f"measured penalty {_fmt(r.measured_penalty, '.3f')} "
            f"[{_fmt(r.measured_penalty_min, '.3f')}, {_fmt(r.measured_penalty_max, '.3f')}] over "
            f"{r.n_batches} batch(es), fit-predicted {_fmt(r.predicted_penalty, '.3f')} "
            f"(longest {r.longest}, median waste {_fmt(r.padding_waste, '.3f')})"
        )
    if len(penalty) and "batch_example_ids" in penalty:
        first = penalty.iloc[0]
        lines.append(f"  {first['pick']}")
        for ids, lengths in zip(
            first["batch_example_ids"], first["batch_example_lengths"], strict=True
        ):
            lines.append(f"  batch: example ids {list(ids)}, lengths {list(lengths)}")
    lines += ["", "## LM head + cross-entropy (forward + backward on real hidden states)"]
    for r in ce.itertuples():
        lines.append(
            f"  {r.variant:24s} {r.status:7s} t={_fmt(r.time_s)} s, share of step "
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
        if control["name"] == "analytic_flops_match_flop_counter":
            observed = control["observed"]
            lines.append(
                f"    analytic / counted linear FLOPs {_fmt(observed['analytic_over_counted'])} "
                f"(old 6N formula / counted total {_fmt(observed['old_6n_over_counted_total'])})"
            )
    lines += ["", f"MFU convention: {fl.MFU_CONVENTION}"]
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
    flop_model = FlopModel(
        params=fl.step_parameters(model),
        head_positions=fl.head_positions_of(harness.module),
        active_params=params["active_params"],
        text_config=text_config,
    )
    has_experts = fl.moe_active_fraction(text_config) is not None
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

    scaling = run_scaling(runner, settings, loss_share, vocab_size, flop_model, peak)
    ok = scaling[scaling["status"] == OK]
    fit = fit_step_time(ok["seq_len"].tolist(), ok["time_s"].tolist())
    LOG.info("fit: %s (%s)", fit.method, fit.message)
    scaling = add_fit_columns(scaling, fit)
    if ok.empty:
        raise ProfileError(
            f"every scaling point failed ({scaling['status'].tolist()} at {settings.lengths}); "
            "lower profile lengths or the micro-batch size."
        )

    # the FLOP count of the MFU convention, checked by counting one real step (smallest length)
    controls.append(
        run_flop_control(
            runner, settings, int(ok["seq_len"].min()), loss_share, vocab_size, flop_model
        )
    )
    # the padding batches come from the upper length band and stay within the lengths that
    # ran, so the fit interpolates them
    try:
        picks = bt.pick_padding_batches(
            train,
            settings.micro_batch,
            int(ok["seq_len"].max()),
            settings.seed,
            profile["padding_draws"],
            profile["padding_waste_quantile"],
        )
        penalty = run_padding_penalty(runner, settings, picks, fit, vocab_size, pad_id)
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
        runner,
        settings,
        probe_length,
        loss_share,
        vocab_size,
        profile["double_count_tolerance"],
        has_experts,
    )
    controls.append(check)

    run = run_metadata(dict(config))
    provenance = {
        "device": device_info,
        "cpu_only": settings.cpu_only,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "dtype_reason": settings.dtype_reason,
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
        "step_parameters": flop_model.params.as_dict(),
        "lm_head_positions": flop_model.head_positions,
        "has_experts": has_experts,
        "peak_tflops": peak,
        "peak_tflops_source": peak_source,
        "mfu_convention": fl.MFU_CONVENTION,
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
        "description": (
            "the scaling fit recovers known coefficients; the analytic FLOP count matches "
            "FlopCounterMode on a real step; kernel sum <= profiled wall"
        ),
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
        "padding_penalty": penalty[
            ["variant", "measured_penalty", "measured_penalty_min", "measured_penalty_max"]
        ].to_dict("records"),
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
