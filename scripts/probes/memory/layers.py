"""Trace a few decoder layers and scale per layer type: the whole model's peak in seconds.

A step's peak is affine in the number of decoder layers of each type, as long as the peak stays
at the same place (the end of the forward without checkpointing; the last layer's recompute with
it): every layer adds its parameters, adapter gradients and optimizer state, and the activations
it keeps for backward; the embeddings, the head, the loss, the masks (one per layer type) and a
tower the text model never runs are paid once. So with K layer types, K + 1 traces fix the line:
one layer of every type (the base), and the base plus one layer of each type in turn. The
prediction is base + Σ_t (N_t - 1) · (trace_t - base), category by category, and the traces must
peak in the same phase, else the figure is refused (`ScaleError`). The reduced models keep the
full model's last layer type last (the layer checkpointing recomputes first).
`tests/unit/memory` checks the scaling against a whole-model trace of a tiny model to the byte.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from probes.memory.predict import (
    FakeStep,
    PredictError,
    Prediction,
    Shape,
    StepFunctions,
    build_fake_step,
    predict,
)
from probes.memory.tracker import CATEGORIES

SINGLE_TYPE = "decoder_layer"


class ScaleError(PredictError):
    """The reduced traces do not peak at the same place: the line does not hold."""


def text_config_of(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's type (one type when the config names none)."""
    text = text_config_of(config)
    n = int(text.num_hidden_layers)
    types = getattr(text, "layer_types", None)
    if types and len(types) == n:
        return [str(t) for t in types]
    return [SINGLE_TYPE] * n


def scaling_saves_work(config: Any) -> bool:
    """Whether the K(K + 2) layers of the K + 1 reduced traces are fewer than the model's."""
    full = layer_types(config)
    k = len(set(full))
    return k * (k + 2) < len(full)


def reduced_types(full: list[str], counts: dict[str, int]) -> list[str]:
    """`counts[t]` layers of each type, in first-appearance order, the last layer's type last."""
    last = full[-1]
    order = [t for t in dict.fromkeys(full) if t != last] + [last]
    return [t for t in order for _ in range(counts[t])]


def reduced_config(config: Any, types: list[str]) -> Any:
    full = layer_types(config)
    reduced = copy.deepcopy(config)
    text = text_config_of(reduced)
    overrides = per_layer_overrides(text, full, types)
    if overrides is not None:
        text.per_layer_config = None  # re-keyed below, once the layer count is the reduced one
    text.num_hidden_layers = len(types)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(types)
    if overrides:
        text.per_layer_config = overrides
    return reduced


def per_layer_overrides(
    text: Any, full: list[str], types: list[str]
) -> dict[int, dict[str, Any]] | None:
    """A heterogeneous config's per-layer overrides (Gemma 4's full-attention layers: their own
    head dim and KV heads) keyed by the reduced model's layer indices: layer i takes the overrides
    of the full model's layers of its type. They are keyed by index, so a reduced model that kept
    the full model's keys would give its layers other layers' shapes. None: not heterogeneous."""
    spec = getattr(text, "_heterogeneity_spec", None)
    if spec is None:
        return None
    by_type: dict[str, dict[str, Any]] = {}
    for index, layer_type in enumerate(full):
        found = dict(spec.per_layer_overrides.get(index, {}))
        if by_type.setdefault(layer_type, found) != found:
            raise ScaleError(
                f"config.json: the {layer_type} layers differ in their per-layer settings "
                f"(per_layer_config), so one layer of the type does not stand for the others; "
                "set memory.scale_layers: false to trace the whole model"
            )
    reduced = {i: copy.deepcopy(by_type[t]) for i, t in enumerate(types)}
    return {i: found for i, found in reduced.items() if found}


@dataclass
class ScaledStep:
    """The base trace's step, one step per layer type with one more layer of that type, the
    check (two layers of every type) that the line must meet, and the whole model, traced where
    it does not."""

    full_counts: dict[str, int]
    base: FakeStep
    extra: dict[str, FakeStep]
    build_seconds: float
    check: FakeStep | None = None
    whole: FakeStep | None = None

    def steps(self) -> list[FakeStep]:
        """Every fake model (a step-level change is set on each)."""
        found = [self.base, *self.extra.values(), self.check, self.whole]
        return [s for s in found if s is not None]

    @property
    def notes(self) -> list[str]:
        n = sum(self.full_counts.values())
        counts = ", ".join(f"{c} {t}" for t, c in self.full_counts.items())
        return [
            f"{len(self.extra) + 1} traces of {len(self.extra)}-{len(self.extra) + 1} decoder "
            f"layers scaled per layer type to the model's {n} ({counts})"
        ]


def build_scaled_step(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    grad_accum: int = 1,
    round_to: int = 1,
    attn_implementation: str = "sdpa",
) -> ScaledStep:
    start = time.perf_counter()
    full = layer_types(config)
    counts = {t: full.count(t) for t in dict.fromkeys(full)}
    base_counts = dict.fromkeys(counts, 1)

    def step_for(layer_counts: dict[str, int] | None) -> FakeStep:
        reduced = (
            config
            if layer_counts is None
            else reduced_config(config, reduced_types(full, layer_counts))
        )
        return build_fake_step(
            reduced, functions, dtype, grad_accum, round_to, attn_implementation=attn_implementation
        )

    base = step_for(base_counts)
    extra = {t: step_for({**base_counts, t: 2}) for t in counts}
    # with one layer type the peak cannot move to another type's layer: no check needed
    check = step_for(dict.fromkeys(counts, 2)) if len(counts) > 1 else None
    whole = step_for(None) if check is not None else None  # built on fake tensors: ~1 s
    return ScaledStep(counts, base, extra, time.perf_counter() - start, check, whole)


def line_at(
    base: Prediction, extra: dict[str, Prediction], counts: dict[str, int]
) -> dict[str, int]:
    """base + Σ_t (counts_t - 1) · (trace_t - base), per category."""
    split = {}
    for category in CATEGORIES:
        value = base.by_category[category]
        for layer_type, found in extra.items():
            per_layer = found.by_category[category] - base.by_category[category]
            value += (counts[layer_type] - 1) * per_layer
        split[category] = value
    return split


def predict_scaled(step: ScaledStep, shape: Shape) -> Prediction:
    """base + Σ_t (N_t - 1) · (trace_t - base), per category; the phases must agree, and the
    line must meet the check trace (two layers of every type) to the byte. Where it does not,
    the peak moved to another layer type's layer between the reduced traces (Gemma 4 26B-A4B at
    2 x 16,384: the 3-layer traces peaked in a sliding layer, the model in its last full one,
    +9.6 %), and the whole model is traced instead, which the figure says."""
    start = time.perf_counter()
    base = predict(step.base, shape)
    extra = {t: predict(s, shape) for t, s in step.extra.items()}
    phases = {base.phase} | {p.phase for p in extra.values()}
    if len(phases) > 1:
        raise ScaleError(
            f"shape {shape.name}: the reduced traces peak in different phases {sorted(phases)}; "
            "set memory.scale_layers: false to trace the whole model"
        )
    ops = base.ops + sum(p.ops for p in extra.values())
    if step.check is not None and step.whole is not None:
        checked = predict(step.check, shape)
        ops += checked.ops
        missed = sum(line_at(base, extra, dict.fromkeys(extra, 2)).values()) - checked.peak_bytes
        if missed:
            whole = predict(step.whole, shape)
            whole.assumptions.insert(
                0,
                f"the whole model traced: the per-layer-type line missed a trace of two layers "
                f"of each type by {missed / 2**30:+.3f} GiB (the peak moves between layer types)",
            )
            whole.seconds = time.perf_counter() - start
            whole.ops += ops
            return whole
    split = line_at(base, extra, step.full_counts)
    return Prediction(
        shape=shape,
        peak_bytes=sum(split.values()),
        by_category=split,
        base_bytes=base.base_bytes,
        phase=base.phase,
        op=base.op,
        seconds=time.perf_counter() - start,
        ops=ops,
        assumptions=step.notes + base.assumptions,
    )
