"""The step the profile times, loaded once (``load_profiled_step`` -> ``ProfiledStep``): the
user's trainer where trainer.factory or trainer.command is set (probes.step.source), else the
harness on the real weights (probes.step.harness, probes.step.runner); and what the MFU
convention counts about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probes.profile import flops as fl
from probes.profile.scaling import FlopModel
from probes.settings import WorkflowConfig
from probes.step.harness import Harness, load_harness
from probes.step.runner import (
    Settings,
    StepRunner,
    load_model,
    model_text_config,
    prepare_harness,
)
from probes.step.source import output_dir, trainer_source
from probes.step.trainer import load_trainer_step, probe_settings

LOG = logging.getLogger("probes.profile")


@dataclass
class ProfiledStep:
    """The step the profile times, loaded once: the harness on the real model, or the user's
    trainer (probes.step.load); what the MFU convention counts about it."""

    runner: Any  # StepRunner | TrainerStep
    model: torch.nn.Module
    harness: Harness | None
    vocab_size: int
    pad_id: int
    params: dict[str, Any]
    trainable: int
    flop_model: FlopModel
    has_experts: bool
    described: dict[str, Any]


def load_profiled_step(
    model_path: str | Path, cfg: WorkflowConfig, settings: Settings
) -> ProfiledStep:
    """The user's trainer where one is given (its model as it built it), else the
    weights in the profiled dtype with the harness's adapters and optimizer."""
    profile = cfg.profile
    source = trainer_source(cfg.trainer)
    if source is not None:
        step_settings = probe_settings(
            output_dir(), settings.device, settings.dtype, None, settings.seed
        )
        runner = load_trainer_step(source, step_settings)
        model, harness, head_positions = runner.model, None, "all"  # the stock loss
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = fl.model_active_parameters(base)
        described = runner.describe()
    else:
        harness = load_harness(profile.harness)
        model = load_model(model_path, settings, profile.attn_implementation)
        params = fl.model_active_parameters(model)
        options = {"ce_chunk_tokens": int(profile.ce_chunk_tokens), **profile.harness_options}
        model, optimizer, targets = prepare_harness(model, harness, options)
        runner = StepRunner(model, harness, optimizer, settings.device)
        head_positions = fl.head_positions_of(harness.module)
        described = {**harness.describe(), "target_modules": targets, "options": options}
    text_config = model_text_config(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    LOG.info(
        "%s: %d trainable params; active params %d",
        described.get("trainer") or described.get("spec"),
        trainable,
        params["active_params"],
    )
    return ProfiledStep(
        runner=runner,
        model=model,
        harness=harness,
        vocab_size=int(text_config["vocab_size"]),
        pad_id=int(text_config.get("pad_token_id") or 0),
        params=params,
        trainable=int(trainable),
        flop_model=FlopModel(
            params=fl.step_parameters(model),
            head_positions=head_positions,
            active_params=params["active_params"],
            text_config=text_config,
        ),
        has_experts=fl.moe_active_fraction(text_config) is not None,
        described=described,
    )
