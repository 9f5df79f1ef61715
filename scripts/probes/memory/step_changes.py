"""The step-level changes the replay prices (probes.step.changes), each predicted on the fake
model at its own largest micro-batch, set the way the replay sets it.

The base step is the one the replay's ``StepSwitch`` reads off the loaded step, so the replay's
``step_changes_for`` gives the replay's names and settings: a user's trainer as the stage that
built it recorded it (``current_config`` of its model and args, ``sc.config_record``); else the
fake model with the harness's own settings (checkpointing among them) and loss kernel, at the
profile's attention implementation (the real model's, not the fake model's SDPA stand-in for a
GPU-only one). The fake model(s) are set to that base
(``at_base``), then each change is set on them, never a rebuilt one, by the replay's own
``apply_config`` (gradient checkpointing as ``enable_checkpointing`` turns it on, the attention
implementation through ``set_attn_implementation``, a GPU-only one stood in for by SDPA) and
the harness's ``configure`` for the loss kernel (``loss_changes.apply_loss``); predicted; and
set back.

Its shape is the largest micro-batch of the plan the replay times for it (the replay's
``change_plans_for``): the baseline's micro-batches; the doubled micro-batch size's own random
plan (tokens per update kept, at its own grad_accum); padding-free's baseline micro-batches,
each flattened into one row. Without plans: the training shape's counterparts (every row full).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd

from probes.memory.predict import PACKED, FakeStep, Shape
from probes.memory.shapes import largest_micro_batches
from probes.replay.step_changes import change_plans_for
from probes.settings import TrainingConfig
from probes.step import changes as sc
from probes.step import loss_changes, padding_free
from probes.step.change_types import PORTABLE_ATTENTION, StepChange, StepConfig

FALLBACK_ATTENTION = "sdpa"  # fake CPU tensors run the portable implementations only
NO_LENGTHS = "no lengths input (--input lengths=): its own plan cannot be built"


@dataclasses.dataclass(frozen=True)
class LoadedHarness:
    """What probes.step.loss_changes reads of a step runner: the harness (probes.step.harness)
    and the options it was configured with (``described["options"]``, as load_step records)."""

    harness: Any
    described: dict[str, Any]


def fake_attention(attn_implementation: str) -> tuple[str, list[str]]:
    """The implementation the fake model is built at (the profile's, as the replay loads it),
    and a note where a GPU-only one is stood in for by SDPA (same O(T) fused memory)."""
    if attn_implementation in PORTABLE_ATTENTION:
        return attn_implementation, []
    return FALLBACK_ATTENTION, [
        f"profile.attn_implementation {attn_implementation}: predicted as {FALLBACK_ATTENTION} "
        "(a fused kernel's O(T) memory; fake CPU tensors cannot run it)"
    ]


def fake_steps(step: Any) -> list[FakeStep]:
    """Every fake model of a predictor's step: one, or the scaled step's reduced traces."""
    return step.steps() if hasattr(step, "steps") else [step]


def base_config(
    step: Any,
    loaded: LoadedHarness | None,
    attn_implementation: str,
    recorded: Mapping[str, Any] | None = None,
) -> StepConfig:
    """The replay's base (StepSwitch's): `recorded` (a user's trainer's config_record) where
    given; else the fake model as the harness set it, at `attn_implementation` (the profile's, as
    the real model is loaded), with the harness's loss kernel (`loaded` None: not a setting)."""
    if recorded is not None:
        return sc.from_record(recorded)
    loss = None if loaded is None else loss_changes.current_loss(loaded)
    current = sc.current_config(fake_steps(step)[0].model)
    return dataclasses.replace(current, attn_implementation=attn_implementation, loss=loss)


def stand_in(config: StepConfig) -> StepConfig:
    """`config` as the fake model can be set: a GPU-only attention implementation as SDPA."""
    attention, _ = fake_attention(config.attn_implementation)
    return dataclasses.replace(config, attn_implementation=attention)


def at_base(predictor: Any, base: StepConfig) -> None:
    """Every fake model of `predictor` set to `base` (checkpointing, attention) before any
    prediction, the stand-in noted where the base's attention is GPU-only."""
    fake = stand_in(base)
    _, notes = fake_attention(base.attn_implementation)
    for step in fake_steps(predictor.step):
        sc.apply_config(step.model, fake)
        step.notes.extend(n for n in notes if n not in step.notes)


def _base_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _has_input_grad_hook(model: Any) -> bool:
    return sc.input_grads_hooked(_base_model(model))


@contextmanager
def configured(
    predictor: Any, loaded: LoadedHarness | None, base: StepConfig, change: StepChange
) -> Iterator[None]:
    """`change` set on every fake model of `predictor` (a CachedPredictor) for the body,
    then the base set back: the input-gradient hook checkpointing added taken off again, so
    the next change is predicted as if set first."""
    steps = fake_steps(predictor.step)
    hooked = [_has_input_grad_hook(s.model) for s in steps]
    accums = [s.grad_accum for s in steps]
    setting = predictor.setting
    try:
        for step in steps:
            sc.apply_config(step.model, stand_in(change.config))
            step.grad_accum = int(change.grad_accum or step.grad_accum)
        if change.config.loss != base.loss and loaded is not None:
            loss_changes.apply_loss(loaded, change.config.loss)
        predictor.setting = (change.config, change.grad_accum)
        yield
    finally:
        predictor.setting = setting
        if change.config.loss != base.loss and loaded is not None:
            loss_changes.apply_loss(loaded, base.loss)
        for step, had_hook, accum in zip(steps, hooked, accums, strict=True):
            sc.apply_config(step.model, stand_in(base))
            if not had_hook and _has_input_grad_hook(step.model):
                _base_model(step.model).disable_input_require_grads()
            step.grad_accum = accum


def change_shapes(
    changes: Sequence[StepChange],
    plans: pd.DataFrame | None,
    inputs: Mapping[str, Any],
    training: TrainingConfig,
    lengths_given: bool,
) -> dict[str, Shape | str]:
    """strategy -> its largest micro-batch over the plan the replay times for it (the replay's
    change_plans_for on the bucket stage's plans, the target's max_seq_len uncapped), or why
    none. Without the lengths input the micro-batch size's own plan cannot be built."""
    micro, max_len = int(training.micro_batch_size), int(training.max_seq_len)
    if plans is None:
        return {c.strategy: full_shape(c, micro, max_len) for c in changes}
    missing: dict[str, str] = {}
    if lengths_given:
        planned = change_plans_for(list(changes), plans, inputs, training, False, max_len)
    else:
        missing = {c.strategy: NO_LENGTHS for c in changes if c.micro_batch_size}
        rest = [c for c in changes if c.strategy not in missing]
        planned = sc.change_plans(plans, rest, {})
    largest = largest_micro_batches(planned)
    out: dict[str, Shape | str] = {}
    for change in changes:
        found = largest.get(change.strategy) or missing.get(change.strategy)
        out[change.strategy] = found or "no micro-batch in its plan (no baseline plan)"
    return out


def full_shape(change: StepChange, micro_batch_size: int, max_seq_len: int) -> Shape:
    """The training shape's counterpart of `change` (no plans: every row full)."""
    if change.micro_batch_size:
        return Shape(change.strategy, int(change.micro_batch_size), max_seq_len)
    if padding_free.is_padding_free(change.strategy):
        return Shape(change.strategy, 1, micro_batch_size * max_seq_len, PACKED)
    return Shape(change.strategy, micro_batch_size, max_seq_len)
