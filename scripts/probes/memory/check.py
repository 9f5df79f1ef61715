"""Predicted vs real peak at the shapes a stage really ran: the check that fails beyond ±tolerance.

For the profile (issue 28, item 4): after a timed step has warmed the optimizer, the profile
measures the real peak of one more step with `probes.memory.real.measure_step_peak` (its own
model, optimizer, harness loss and batch), and `real_vs_predicted` predicts the same shapes on
fake tensors from the same config.json, harness and dtype (`round_to` 512 on CUDA, 1 on CPU) and
returns a control entry: passed when every shape is within ±tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.memory.control import entry, within
from probes.memory.predict import (
    PredictError,
    Shape,
    StepFunctions,
    build_fake_step,
    predict,
)


def real_vs_predicted(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    real: Mapping[tuple[int, int], int],
    tolerance: float = 0.10,
    grad_accum: int = 1,
    round_to: int = 1,
) -> dict[str, Any]:
    """`real`: (rows, length) -> real peak bytes of that step; one row per shape in `rows`."""
    step = build_fake_step(config, functions, dtype, grad_accum, round_to)
    rows = []
    for (n_rows, length), real_bytes in sorted(real.items()):
        shape = Shape(f"{n_rows}x{length}", int(n_rows), int(length))
        try:
            predicted = predict(step, shape).peak_bytes
        except PredictError as error:
            rows.append({"rows": n_rows, "length": length, "real_bytes": int(real_bytes),
                         "predicted_bytes": None, "ratio": None, "passed": False,
                         "reason": str(error)})  # fmt: skip
            continue
        rows.append(
            {
                "rows": n_rows,
                "length": length,
                "real_bytes": int(real_bytes),
                "predicted_bytes": predicted,
                "ratio": predicted / real_bytes if real_bytes else None,
                "passed": within(predicted, real_bytes, tolerance),
            }
        )
    result = entry(
        "memory_real_steps",
        f"the fake-tensor prediction against the real peak of the same steps, within "
        f"±{tolerance:.0%}",
        {"tolerance": tolerance, "shapes": len(rows)},
        {"within": sum(r["passed"] for r in rows)},
        bool(rows) and all(r["passed"] for r in rows),
    )
    result["rows"] = rows
    return result
