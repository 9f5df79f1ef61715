"""The step-level changes the replay prices (probes.step.changes), each predicted on the fake
model at its own largest micro-batch, set the way the replay sets it.

The base step is read off the fake model and the harness as the replay's ``StepSwitch`` reads it
off the loaded one (``current_config``, the harness's loss kernel), so ``step_changes`` gives the
replay's names. Each change is set on the same fake model(s), never a rebuilt one, by the
replay's own ``apply_config`` (gradient checkpointing as ``enable_checkpointing`` turns it on,
the attention implementation through ``set_attn_implementation``) and the harness's
``configure`` for the loss kernel (``loss_changes.apply_loss``); predicted; and set back.

Its shape is the largest micro-batch of the plan the replay times for it (``change_plans``):
the baseline's micro-batches; the doubled micro-batch size's own random plan
(``micro_batch_plans``, tokens per update kept, at its own grad_accum); padding-free's baseline
micro-batches, each flattened into one row. Without plans: the training shape's counterparts
(every row full).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd

from probes.memory.predict import PACKED, FakeStep, Shape
from probes.memory.shapes import largest_micro_batches
from probes.step import changes as sc
from probes.step import loss_changes, padding_free
from probes.step.change_types import PORTABLE_ATTENTION, StepChange, StepConfig

FALLBACK_ATTENTION = "sdpa"  # fake CPU tensors run the portable implementations only


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
    extra = getattr(step, "extra", None)
    return [step] if extra is None else [step.base, *extra.values()]


def base_config(step: Any, loaded: LoadedHarness | None) -> StepConfig:
    """The step as the fake model and the harness are set now (StepSwitch's base); `loaded`
    None: the loss is not a setting of the step (a user's trainer)."""
    loss = None if loaded is None else loss_changes.current_loss(loaded)
    return dataclasses.replace(sc.current_config(fake_steps(step)[0].model), loss=loss)


def _base_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _has_input_grad_hook(model: Any) -> bool:
    return sc.input_grads_hooked(_base_model(model))


@contextmanager
def configured(
    predictor: Any, loaded: LoadedHarness | None, base: StepConfig, change: StepChange
) -> Iterator[None]:
    """`change` set on every fake model of `predictor` (a stage CachedPredictor) for the body,
    then the base set back: the input-gradient hook checkpointing added taken off again, so
    the next change is predicted as if set first."""
    steps = fake_steps(predictor.step)
    hooked = [_has_input_grad_hook(s.model) for s in steps]
    accums = [s.grad_accum for s in steps]
    setting = predictor.setting
    try:
        for step in steps:
            sc.apply_config(step.model, change.config)
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
            sc.apply_config(step.model, base)
            if not had_hook and _has_input_grad_hook(step.model):
                _base_model(step.model).disable_input_require_grads()
            step.grad_accum = accum


def change_shapes(
    changes: Sequence[StepChange],
    plans: pd.DataFrame | None,
    examples: Any,
    seed: int,
    micro_batch_size: int,
    max_seq_len: int,
) -> dict[str, Shape | str]:
    """strategy -> its largest micro-batch over the plan the replay times for it, or why none.
    `examples` (probes.batching.plans.read_examples) build the micro-batch size's own plan."""
    if plans is None:
        return {c.strategy: full_shape(c, micro_batch_size, max_seq_len) for c in changes}
    missing = {}
    if examples is None:
        missing = {
            c.strategy: "no lengths input (--input lengths=): its own plan cannot be built"
            for c in changes
            if c.micro_batch_size
        }
    planned = [c for c in changes if c.strategy not in missing]
    micro_plans = {}
    if examples is not None:
        micro_plans = sc.micro_batch_plans(planned, examples, max_seq_len, seed)
    largest = largest_micro_batches(sc.change_plans(plans, planned, micro_plans))
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
