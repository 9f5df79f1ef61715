"""A harness that trains every weight (no adapters): the reference harness's loss and AdamW over
all parameters. Importable by spawned ranks (probes.memory.fsdp_real takes an import path)."""

from __future__ import annotations

from torch import nn

from probes.step.reference_harness import build_optimizer, compute_loss, configure

__all__ = ["apply_adapters", "build_optimizer", "compute_loss", "configure"]


def discover_target_modules(model: nn.Module) -> list[str]:
    return []


def apply_adapters(model: nn.Module, target_modules: list[str]) -> nn.Module:
    """Full fine-tuning: every parameter trains; checkpointing as the options say."""
    from probes.step import reference_harness

    if reference_harness.OPTIONS["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
