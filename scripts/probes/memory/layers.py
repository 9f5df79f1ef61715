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
    reduced = copy.deepcopy(config)
    text = text_config_of(reduced)
    text.num_hidden_layers = len(types)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(types)
    return reduced


@dataclass
class ScaledStep:
    """The base trace's step and one step per layer type with one more layer of that type."""

    full_counts: dict[str, int]
    base: FakeStep
    extra: dict[str, FakeStep]
    build_seconds: float

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

    def step_for(layer_counts: dict[str, int]) -> FakeStep:
        reduced = reduced_config(config, reduced_types(full, layer_counts))
        return build_fake_step(
            reduced, functions, dtype, grad_accum, round_to, attn_implementation=attn_implementation
        )

    base = step_for(base_counts)
    extra = {t: step_for({**base_counts, t: 2}) for t in counts}
    return ScaledStep(counts, base, extra, time.perf_counter() - start)


def predict_scaled(step: ScaledStep, shape: Shape) -> Prediction:
    """base + Σ_t (N_t - 1) · (trace_t - base), per category; the phases must agree."""
    start = time.perf_counter()
    base = predict(step.base, shape)
    extra = {t: predict(s, shape) for t, s in step.extra.items()}
    phases = {base.phase} | {p.phase for p in extra.values()}
    if len(phases) > 1:
        raise ScaleError(
            f"shape {shape.name}: the reduced traces peak in different phases {sorted(phases)}; "
            "set memory.scale_layers: false to trace the whole model"
        )
    split = {}
    for category in CATEGORIES:
        value = base.by_category[category]
        for layer_type, found in extra.items():
            per_layer = found.by_category[category] - base.by_category[category]
            value += (step.full_counts[layer_type] - 1) * per_layer
        split[category] = value
    return Prediction(
        shape=shape,
        peak_bytes=sum(split.values()),
        by_category=split,
        base_bytes=base.base_bytes,
        phase=base.phase,
        op=base.op,
        seconds=time.perf_counter() - start,
        ops=base.ops + sum(p.ops for p in extra.values()),
        assumptions=step.notes + base.assumptions,
    )
