"""What a step-level change is made of: the step's settings (``StepConfig``), a change with the
settings it pastes (``StepChange``), and the attention implementations by where they run.
probes.step.changes builds the changes; the loss-kernel and padding-free modules and the mask gate
read these types and names from here."""

from __future__ import annotations

import dataclasses
from typing import Any

# attention implementations that run on any device; flash/flex need a GPU build (listed, not
# priced, on CPU)
PORTABLE_ATTENTION = ("eager", "sdpa")
GPU_ONLY_ATTENTION = ("flash_attention_2", "flex_attention")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    gradient_checkpointing: bool
    attn_implementation: str
    loss: str | None = None  # the harness's loss kernel or TRL's loss_type (None: not a setting)
    # the trainer's dataloader workers (None: not a setting of this step, the harness path)
    dataloader_num_workers: int | None = None


@dataclasses.dataclass(frozen=True)
class StepChange:
    strategy: str
    title: str
    config: StepConfig
    settings: dict[str, Any]  # what pastes into TrainingArguments / SFTConfig / from_pretrained
    micro_batch_size: int | None = None  # set: a new plan at this size (tokens per update kept)
    grad_accum: int | None = None
