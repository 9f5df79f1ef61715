"""The harness bench/realized_vs_promised.py replays with: what ``transformers.Trainer`` does by
default to a causal LM, so the replay and the real Trainer run the same step. Full fine-tuning
(no adapters), torch AdamW at the Trainer's default hyper-parameters, and the model's own loss
(``model(**batch).loss``, the Trainer's ``compute_loss`` without a custom loss)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LEARNING_RATE = 1e-4  # the bench's TrainingArguments(learning_rate=...) uses this too


def discover_target_modules(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def apply_adapters(model: nn.Module, target_modules: list[str]) -> nn.Module:
    return model  # full fine-tuning, as a plain Trainer


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Trainer's default optim "adamw_torch": torch AdamW, betas (0.9, 0.999), eps 1e-8, wd 0
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, weight_decay=0.0
    )


def compute_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss
