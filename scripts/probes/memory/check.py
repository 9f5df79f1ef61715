"""Predicted vs real peak at the shapes a stage really ran: the check that fails beyond ±tolerance.

For the profile (issue 28, item 4): after a timed step has warmed the optimizer, the profile
measures the real peak of one more step of its own runner with `probes.memory.real.measure_peak`,
and predicts the same shapes on fake tensors: `real_vs_predicted` from the same config.json,
harness and dtype (`round_to` 512 on CUDA, 1 on CPU); `trainer_vs_predicted` through the user's
trainer itself (`probes.memory.trainer`). A shape is its rows, length and loss positions (the
positions whose hidden state predicts a labelled token): the chunked loss holds a
[loss positions, vocabulary] float32 block, so a prediction at every position of a batch whose
loss share is 41 % read 1.11-1.29x the real peak of the default model at 2 x 32-128. Returns a
control entry: passed when every shape is within ±tolerance, with a message naming those that
are not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from probes.memory.control import entry, within
from probes.memory.predict import (
    PredictError,
    Shape,
    StepFunctions,
    build_fake_step,
    predict,
)

NAME = "memory_real_steps"


def real_vs_predicted(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    real: Mapping[Shape, int],
    tolerance: float = 0.10,
    grad_accum: int = 1,
    round_to: int = 1,
) -> dict[str, Any]:
    """`real`: shape -> real peak bytes of that step of the harness; one row per shape."""
    step = build_fake_step(config, functions, dtype, grad_accum, round_to)
    return compare(lambda shape: predict(step, shape).peak_bytes, real, tolerance)


def trainer_vs_predicted(
    trainer_step: Any, real: Mapping[Shape, int], tolerance: float = 0.10, round_to: int = 1
) -> dict[str, Any]:
    """`real`: shape -> real peak bytes of that step of the user's trainer (a TrainerStep)."""
    from probes.memory.trainer import fake_trainer, predict_trainer

    with fake_trainer(trainer_step, round_to) as fake:
        return compare(lambda shape: predict_trainer(fake, shape).peak_bytes, real, tolerance)


def compare(
    predict_peak: Callable[[Shape], int], real: Mapping[Shape, int], tolerance: float
) -> dict[str, Any]:
    """One row per shape, predicted against real; the control entry over them all."""
    rows = []
    for shape, real_bytes in sorted(real.items(), key=lambda item: (item[0].rows, item[0].length)):
        row = {
            "rows": shape.rows,
            "length": shape.length,
            "loss_positions": shape.loss_positions(),
            "real_bytes": int(real_bytes),
        }
        try:
            predicted = int(predict_peak(shape))
        except PredictError as error:
            rows.append({**row, "predicted_bytes": None, "ratio": None, "passed": False,
                         "reason": str(error)})  # fmt: skip
            continue
        ratio = predicted / real_bytes if real_bytes else None
        rows.append(
            {
                **row,
                "predicted_bytes": predicted,
                "ratio": ratio,
                "passed": within(predicted, real_bytes, tolerance),
            }
        )
    passed = bool(rows) and all(r["passed"] for r in rows)
    result = entry(
        NAME,
        f"the fake-tensor prediction against the real peak of the same steps, within "
        f"±{tolerance:.0%}",
        {"tolerance": tolerance, "shapes": len(rows)},
        {
            "within": sum(r["passed"] for r in rows),
            "ratios": {f"{r['rows']}x{r['length']}": r["ratio"] for r in rows},
        },
        passed,
    )
    result["rows"] = rows
    if not passed:
        result["message"] = failure_message(rows, tolerance)
    return result


def failure_message(rows: list[dict[str, Any]], tolerance: float) -> str:
    """Which shapes the prediction missed, by how much, and what to do."""
    if not rows:
        return "no real step was measured: nothing to check the prediction against"
    missed = []
    for r in rows:
        if r["passed"]:
            continue
        if r["ratio"] is None:
            missed.append(f"{r['rows']} x {r['length']}: not predicted ({r.get('reason', '')})")
            continue
        missed.append(
            f"{r['rows']} x {r['length']} ({r['loss_positions']} loss positions): predicted "
            f"{r['predicted_bytes'] / 2**20:.1f} MiB, real {r['real_bytes'] / 2**20:.1f} MiB "
            f"({r['ratio']:.3f}x)"
        )
    return (
        f"the memory prediction is off by more than ±{tolerance:.0%} at "
        + "; ".join(missed)
        + ": every 'fits' verdict rests on it. Report the shapes and the step (harness or "
        "trainer) as a bug, or set memory.tolerance / memory.enabled: false to go on without it."
    )
