"""The step every timing stage runs: the user's trainer where ``trainer.factory`` or
``trainer.command`` is set (probes.step.source), else the ``profile.harness`` module on the real
model. Both implement probes.step.runner.StepRunner's
small interface, so replay and realize have one code path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from probes.settings import TrainerConfig, WorkflowConfig


def factory_of(trainer: TrainerConfig) -> str | None:
    """What the trainer section names (its factory spec or its command), None: the harness."""
    from probes.step.command import command_argv, shown
    from probes.step.source import given

    if not given(trainer):
        return None
    return trainer.factory or shown(command_argv(trainer.command))


def load_step(
    cfg: WorkflowConfig,
    model_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_length: int | None,
    seed: int = 0,
) -> tuple[Any, int, int, dict[str, Any]]:
    """(step, vocab size, pad id, description) for the workflow config `cfg` (its trainer and
    profile sections)."""
    from probes.step import runner as ts
    from probes.step.source import output_dir, trainer_source

    source = trainer_source(cfg.trainer)
    if source is not None:
        from probes.step.trainer import load_trainer_step, probe_settings

        # built at its own max_length (its rows and their numbers stay those the padding stage
        # counted); on a CPU rehearsal (`max_length`) each row is scaled to its rehearsal length
        settings = probe_settings(output_dir(), device, dtype, None, seed)
        full = int(cfg.training.max_seq_len)
        rehearsal = (int(max_length), full) if max_length and max_length < full else None
        step = load_trainer_step(source, settings, rehearsal)
        text = ts.model_text_config(step.model)
        return step, int(text["vocab_size"]), int(text.get("pad_token_id") or 0), step.describe()
    model, harness, optimizer, targets, options = ts.load_for_steps(
        model_path, ts.harness_section(cfg.profile), device, dtype
    )
    runner = ts.StepRunner(model, harness, optimizer, device)
    runner.described = {"target_modules": len(targets), "options": options}
    text = ts.model_text_config(model)
    return runner, int(text["vocab_size"]), int(text.get("pad_token_id") or 0), runner.describe()
