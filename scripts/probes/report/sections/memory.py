"""The "Memory" section: will each setting fit the target GPU (probes.memory)?

Per shape (the training shape, the p99 length, each strategy's largest micro-batch): the predicted
peak by category, the headroom against the target and the verdict; the largest micro-batch that
fits at max_seq_len and at the p99 length; the stage's controls; one figure (`memory_figure`).
Sources: `results/memory/shapes.parquet`, `fit.parquet`, `summary.json`, `control.json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.report.format import finite
from probes.report.sections.shared import not_run_section, records, stage_text

STAGE = "memory"
CATEGORY_COLUMNS = (
    ("parameters_gib", "parameters"),
    ("gradients_gib", "gradients"),
    ("optimizer_state_gib", "optimizer state"),
    ("activations_gib", "activations + temporaries"),
)


def memory_report_section(
    tables: Mapping[str, pd.DataFrame], jsons: Mapping[str, Any], not_run: Mapping[str, str]
) -> dict[str, Any]:
    """Everything the Memory block of the template renders; status not_run without the stage."""
    if STAGE in not_run:
        return not_run_section(not_run[STAGE])
    shapes = tables.get("memory_shapes")
    if shapes is None or shapes.empty:
        return not_run_section("the memory stage wrote no shape")
    summary = jsons.get("memory_summary") or {}
    control = jsons.get("memory_control") or {}
    rows = records(shapes, table_columns("memory_shapes"))
    for row in rows:
        reason, assumed = row.get("reason"), row.get("assumptions")
        row["reason"] = stage_text(reason, 160) if isinstance(reason, str) and reason else ""
        row["assumptions"] = stage_text(assumed, 600) if isinstance(assumed, str) else ""
    assumptions = sorted({a.strip() for r in rows for a in r["assumptions"].split(";") if a})
    fit = tables.get("memory_fit")
    return {
        "status": "ok",
        "target": stage_text(summary.get("target", "target GPU")),
        "target_gib": finite(summary.get("target_gib")),
        "dtype": stage_text(summary.get("dtype", "")),
        "gradient_checkpointing": bool(summary.get("gradient_checkpointing")),
        "rows": rows,
        "not_fitting": [r for r in rows if r.get("verdict") == "does not fit"],
        "fit": [] if fit is None else records(fit, table_columns("memory_fit")),
        "assumptions": assumptions,
        "controls": [
            {"name": stage_text(c.get("name")), "passed": bool(c.get("passed"))}
            for c in control.get("checks", [])
        ],
        "controls_passed": bool(control.get("passed")),
    }


def memory_figure(shapes: pd.DataFrame, path: str | Path, dpi: int = 110) -> Path | None:
    """Stacked bars per shape: the predicted peak by category, the target as a line."""
    if shapes is None or shapes.empty or "predicted_peak_gib" not in shapes:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = shapes[shapes["predicted_peak_gib"].notna()]
    if frame.empty:
        return None
    # horizontal bars: a label per shape stays readable however many changes are predicted
    labels = [f"{s}  ({r} × {n:,})" for s, r, n in zip(frame["shape"], frame["rows"],
                                                       frame["length"], strict=True)]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.32 * len(frame) + 1.2)))
    left = [0.0] * len(frame)
    for column, name in CATEGORY_COLUMNS:
        if column not in frame:
            continue
        values = frame[column].fillna(0).tolist()
        ax.barh(labels, values, left=left, label=name)
        left = [b + v for b, v in zip(left, values, strict=True)]
    target = finite(frame["target_gib"].iloc[0]) if "target_gib" in frame else None
    if target is not None:
        ax.axvline(target, color="black", linestyle="--", linewidth=1, label="target")
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("predicted peak (GiB)")
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return path
