"""The Python a user pastes for a change: imports, the ``args = ...`` line, the trainer line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def call_text(name: str, kwargs: Mapping[str, Any]) -> str:
    """``name(k=v, ...)`` with Python literals (the text a user pastes)."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


def snippet(imports: list[str], args_line: str | None, trainer_lines: list[str]) -> dict[str, Any]:
    lines = [*imports, ""]
    if args_line:
        lines.append(args_line)
    lines += trainer_lines
    return {"imports": imports, "args": args_line, "text": "\n".join(lines).strip() + "\n"}


def config_snippets(
    training_arguments: Mapping[str, Any] | None,
    sft_config: Mapping[str, Any] | None,
    trainer_expr: Mapping[str, str],
    extra_imports: list[str] | None = None,
    data_lines: list[str] | None = None,
) -> dict[str, Any]:
    """Snippets for the plain Trainer and for TRL's SFTTrainer."""
    out: dict[str, Any] = {}
    extra = extra_imports or []
    data = data_lines or []
    if training_arguments is not None:
        out["transformers"] = snippet(
            ["from transformers import Trainer, TrainingArguments", *extra],
            "args = " + call_text("TrainingArguments", training_arguments),
            [*data, trainer_expr["transformers"]],
        )
    if sft_config is not None:
        out["trl"] = snippet(
            ["from trl import SFTConfig, SFTTrainer", *extra],
            "args = " + call_text("SFTConfig", sft_config),
            [*data, trainer_expr["trl"]],
        )
    return out
