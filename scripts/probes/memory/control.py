"""The memory stage's positive controls: a peak known by construction, and real steps.

1. `known_model_control`: two weight matrices, `loss = (relu(x @ W1) @ W2).sum()`, AdamW, float32.
   Its peak is written down by hand (below) and the fake-tensor prediction must equal it to the
   byte, category by category.
2. `real_step_control`: the same model as a real CPU step, measured by the profiler's allocator
   events (`probes.memory.real`, not the predictor's tracker): within ±tolerance. Then a prediction
   that leaves out the optimizer state is put to the same check and must fail it (the check can
   fail).
3. `harness_step_control`: a tiny random-init Gemma 3 with the harness's adapters, loss and
   optimizer, predicted on fake tensors and measured as a real CPU step: within ±tolerance.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from probes.errors import ControlFailedError
from probes.memory.predict import (
    Shape,
    StepFunctions,
    build_fake_step,
    make_batch,
    predict,
    traced_step,
    warm_optimizer,
)
from probes.memory.real import measure_step_peak
from probes.memory.tracker import (
    ACTIVATIONS,
    GRADIENTS,
    OPTIMIZER,
    PARAMETERS,
    StepTracker,
)

FLOAT32 = 4
# The known model: N rows of D features, hidden width H; sized so the peak is in the backward
# pass and the optimizer state is a fifth of it (leaving it out must fail a ±10 % check).
KNOWN_N, KNOWN_D, KNOWN_H = 256, 96, 96
# A 4-layer Gemma 3 text model (3 sliding, window 8 : 1 full) for the harness control.
TINY_GEMMA3 = {
    "model_type": "gemma3_text",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
}
HARNESS_SHAPE = Shape("control", 2, 128)


class KnownModel(nn.Module):
    def __init__(self, d: int = KNOWN_D, h: int = KNOWN_H) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(d, h))
        self.w2 = nn.Parameter(torch.zeros(h, d))


def known_loss(model: KnownModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (torch.relu(batch["x"] @ model.w1) @ model.w2).sum()


def known_peak(n: int = KNOWN_N, d: int = KNOWN_D, h: int = KNOWN_H) -> dict[str, int]:
    """The known model's peak by hand, in bytes per category.

    Before the step: W1, W2 (d·h each), AdamW's exp_avg and exp_avg_sq for both, a float32 `step`
    scalar per parameter, the input x (n·d). The forward holds x@W1 (n·h) and its relu (n·h, saved
    for backward), frees x@W1; relu@W2 (n·d) is summed to the loss scalar and freed (sum saves no
    input). The backward seeds a ones scalar, expands it (a view), forms W2.grad = relu^T·g (h·d)
    and g·W2^T (n·h), then relu's backward allocates its output (n·h) while relu and g·W2^T are
    live: the peak, before W1.grad exists. Activations at the peak: x, relu, g·W2^T, the new grad
    (n·d + 3·n·h) plus the loss and its seed scalar.
    """
    return {
        PARAMETERS: 2 * d * h * FLOAT32,
        GRADIENTS: h * d * FLOAT32,
        OPTIMIZER: 4 * d * h * FLOAT32 + 2 * FLOAT32,
        ACTIVATIONS: (n * d + 3 * n * h) * FLOAT32 + 2 * FLOAT32,
    }


def _known_step(fake: bool) -> tuple[KnownModel, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        model = KnownModel()
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        warm_optimizer(model, optimizer)
        batch = {"x": torch.ones(KNOWN_N, KNOWN_D)}
    return model, optimizer, batch


def predict_known() -> dict[str, Any]:
    """The known model's step on fake tensors, through the predictor's own path."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = KnownModel()
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        warm_optimizer(model, optimizer)
        batch = {"x": torch.ones(KNOWN_N, KNOWN_D)}
        return traced_step(model, optimizer, known_loss, batch, StepTracker())


def within(predicted: float, real: float, tolerance: float) -> bool:
    return real > 0 and abs(predicted / real - 1.0) <= tolerance


def entry(name: str, description: str, expected: Any, observed: Any, passed: bool) -> dict:
    return {
        "name": name,
        "description": description,
        "expected": expected,
        "observed": observed,
        "passed": bool(passed),
    }


def known_model_control() -> dict[str, Any]:
    hand = known_peak()
    predicted = predict_known()
    observed = dict(predicted["by_category"], total=predicted["peak_bytes"])
    expected = dict(hand, total=sum(hand.values()))
    return entry(
        "known_model",
        "a two-matrix model whose peak is written down by hand, predicted on fake tensors: "
        "equal to the byte in every category",
        expected,
        observed,
        expected == observed,
    )


def real_step_control(tolerance: float) -> list[dict[str, Any]]:
    model, optimizer, batch = _known_step(fake=False)
    real = measure_step_peak(model, optimizer, known_loss, batch)["peak_bytes"]
    predicted = predict_known()
    total = predicted["peak_bytes"]
    without_optimizer = total - predicted["by_category"][OPTIMIZER]
    return [
        entry(
            "known_model_real_step",
            f"the known model's prediction against its real CPU step (profiler allocator "
            f"events): within ±{tolerance:.0%}",
            {"real_bytes": real, "tolerance": tolerance},
            {"predicted_bytes": total, "ratio": total / real},
            within(total, real, tolerance),
        ),
        entry(
            "check_can_fail",
            "the same check given a prediction without the optimizer state must fail",
            {"fails": True},
            {"predicted_bytes": without_optimizer, "ratio": without_optimizer / real},
            not within(without_optimizer, real, tolerance),
        ),
    ]


def harness_step_control(
    functions: StepFunctions, tolerance: float, shape: Shape = HARNESS_SHAPE
) -> dict[str, Any]:
    """A tiny Gemma 3 through the harness: fake prediction vs real CPU step, float32."""
    from probes.mask.trace import config_from_dict

    step = build_fake_step(config_from_dict(dict(TINY_GEMMA3)), functions, "float32")
    predicted = predict(step, shape).peak_bytes
    real = real_harness_peak(functions, shape)
    return entry(
        "harness_real_step",
        f"a tiny random-init Gemma 3 through the harness (adapters, loss, optimizer) at "
        f"{shape.rows} x {shape.length}: fake prediction against the real CPU step, "
        f"within ±{tolerance:.0%}",
        {"real_bytes": real, "tolerance": tolerance},
        {"predicted_bytes": predicted, "ratio": predicted / real},
        within(predicted, real, tolerance),
    )


def real_harness_peak(functions: StepFunctions, shape: Shape) -> int:
    from transformers import AutoModelForCausalLM

    from probes.mask.trace import config_from_dict

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config_from_dict(dict(TINY_GEMMA3)), dtype=torch.float32, attn_implementation="sdpa"
    )
    if functions.apply_adapters is not None:
        model = functions.apply_adapters(model, functions.discover_target_modules(model))
    model.train()
    optimizer = functions.build_optimizer(model)
    warm_optimizer(model, optimizer)
    batch = make_batch(shape)
    batch["input_ids"] = torch.randint(0, TINY_GEMMA3["vocab_size"], batch["input_ids"].shape)
    batch["labels"] = batch["input_ids"].clone()
    return int(measure_step_peak(model, optimizer, functions.compute_loss, batch)["peak_bytes"])


def run_controls(functions: StepFunctions, tolerance: float) -> dict[str, Any]:
    """Every control; raises ControlFailedError naming the first that failed."""
    checks = [known_model_control(), *real_step_control(tolerance)]
    checks.append(harness_step_control(functions, tolerance))
    failed = [c["name"] for c in checks if not c["passed"]]
    result = entry(
        "memory_controls",
        "the predictor recovers a peak known by construction and real CPU steps within "
        f"±{tolerance:.0%}",
        "every check passes",
        f"{len(checks) - len(failed)}/{len(checks)} passed",
        not failed,
    )
    result["checks"] = checks
    if failed:
        raise ControlFailedError(
            f"memory control failed: {failed}; the prediction is not trusted "
            f"({[c['observed'] for c in checks if not c['passed']]})"
        )
    return result
