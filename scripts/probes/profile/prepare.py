"""What the profile knows before any weights load: its settings for the device
(``resolve_settings``; a note when its lengths pass training.max_seq_len), which tokens carry
loss, whether a micro-batch fits the data at all, and the peak TFLOP/s MFU divides by."""

from __future__ import annotations

import logging
from typing import Any

import torch

from probes.profile import flops as fl
from probes.settings import ProfileConfig, TrainingConfig
from probes.step import batches as bt
from probes.step.dtype import resolve_dtype
from probes.step.runner import ProfileError, Settings, resolve_device

LOG = logging.getLogger("probes.profile")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_settings(profile: ProfileConfig, training: TrainingConfig) -> Settings:
    device = resolve_device(profile.device, profile.allow_cpu)
    per_device = profile.cuda if device.type == "cuda" else profile.cpu
    lengths = sorted({int(v) for v in per_device.lengths})
    if len(lengths) < 3:
        raise ProfileError(
            f"profile.{device.type}.lengths: {lengths} has {len(lengths)} distinct length(s); the "
            "scaling fit t(T)=aT^2+bT+c needs at least 3."
        )
    dtype_name, dtype_reason = resolve_dtype(profile.dtype, device.type)
    return Settings(
        device=device,
        cpu_only=device.type != "cuda",
        dtype=DTYPES[dtype_name],
        dtype_reason=dtype_reason,
        lengths=lengths,
        warmup=int(per_device.warmup),
        repeats=int(per_device.repeats),
        kernel_steps=int(per_device.kernel_steps),
        probe_length=per_device.probe_length,
        micro_batch=int(profile.micro_batch_size or training.micro_batch_size),
        max_seq_len=int(training.max_seq_len),
        seed=int(profile.seed),
    )


def lengths_note(settings: Settings, device_type: str) -> str | None:
    """What to know when the profile times lengths beyond training.max_seq_len (none it trains
    at): said in the log and the provenance, never silently."""
    beyond = [n for n in settings.lengths if n > settings.max_seq_len]
    if not beyond:
        return None
    return (
        f"profile.{device_type}.lengths {beyond} exceed training.max_seq_len="
        f"{settings.max_seq_len}: those step times are at lengths this training never reaches "
        f"(set profile.{device_type}.lengths to at least 3 lengths <= {settings.max_seq_len})"
    )


def training_loss_share(
    train: Any, profile: ProfileConfig, training: TrainingConfig
) -> tuple[float, str]:
    """Which tokens carry loss (training.loss_on): the padding stage counted them per example."""
    if profile.loss_fraction is not None:
        return float(profile.loss_fraction), "config profile.loss_fraction"
    if training.loss_on == "all":
        return 1.0, "training.loss_on: all"
    return bt.loss_fraction(
        train
    ), "n_loss_tokens / n_tokens of the padding lengths (training.loss_on)"


def check_batchable(train: Any, settings: Settings) -> None:
    """Fail before loading weights if no micro-batch fits the longest length at all; with fewer
    examples than a micro-batch no length can help: the penalty is skipped, said, the rest runs."""
    if len(train) >= settings.micro_batch:
        bt.padding_length_band(train, max(settings.lengths), settings.micro_batch)
    else:
        LOG.warning(
            "%s",
            bt.too_few_for_a_batch(train, len(train), max(settings.lengths), settings.micro_batch),
        )


def peak_of(profile: ProfileConfig, settings: Settings, device_name: str) -> tuple[Any, str]:
    """The peak TFLOP/s MFU divides by, and where it came from."""
    if profile.peak_tflops is not None:
        return profile.peak_tflops, "config profile.peak_tflops"
    peak = fl.peak_tflops_for(device_name) if not settings.cpu_only else None
    if peak is not None:
        return peak, f"bf16 dense peak for '{device_name}'"
    return None, "unknown for this device: MFU is NaN (set profile.peak_tflops)"


def logged_settings(
    profile: ProfileConfig, training: TrainingConfig
) -> tuple[Settings, str | None]:
    """The settings for this device, said in the log, with the note (also warned) when the
    profile's lengths pass training.max_seq_len."""
    settings = resolve_settings(profile, training)
    LOG.info(
        "device %s%s, lengths %s, micro-batch %d",
        settings.device,
        " (CPU-only: small lengths, no device kernels)" if settings.cpu_only else "",
        settings.lengths,
        settings.micro_batch,
    )
    beyond_note = lengths_note(settings, settings.device.type)
    if beyond_note:
        LOG.warning("%s", beyond_note)
    return settings, beyond_note
