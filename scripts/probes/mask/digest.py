"""What the gate decided, without what it measured: per scenario and layer the dispatch verdicts
(mask or is_causal, fast path, GQA path, backend) and whether the band held, and per attention
implementation its status per scenario. Two gates agree when their digests are equal (the tests
and bench/mask_large.py compare this gate's against the previous one's)."""

from __future__ import annotations

from typing import Any

import pandas as pd

LAYER_VERDICTS = (
    "layer_type",
    "attn_implementation",
    "mask_present",
    "is_causal",
    "fast_path",
    "gqa_path",
    "backend",
    "band_ok",
)


def _plain(value: Any) -> Any:
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return None
    return value.item() if hasattr(value, "item") else value


def layer_runs(part: pd.DataFrame) -> list[list[Any]]:
    """The layers' verdicts in order, as runs: [["<verdict>|<verdict>...", how many layers]]."""
    runs: list[list[Any]] = []
    for _, row in part.iterrows():
        text = "|".join(str(_plain(row[column])) for column in LAYER_VERDICTS)
        if runs and runs[-1][0] == text:
            runs[-1][1] += 1
        else:
            runs.append([text, 1])
    return runs


def digest(layers: pd.DataFrame, gate: dict[str, Any]) -> dict[str, Any]:
    """The gate's verdicts: passed, per scenario its layers' runs and violating layers, per
    implementation its status, whether packing was checked, per scenario status and violations."""
    scenarios = {
        str(name): {
            "layers": layer_runs(part),
            "violating_layers": [int(i) for i in part.loc[part["violation"].notna(), "layer_idx"]],
        }
        for name, part in layers.groupby("scenario", sort=False)
    }
    implementations = {
        name: {
            "status": verdict["status"],
            "packed_checked": verdict["packed_checked"],
            "scenarios": {
                entry["scenario"]: [entry["status"], entry["violations"]]
                for entry in verdict["per_scenario"]
            },
        }
        for name, verdict in (gate.get("implementations") or {}).items()
    }
    return {
        "passed": bool(gate["passed"]),
        "scenarios": scenarios,
        "implementations": implementations,
    }
