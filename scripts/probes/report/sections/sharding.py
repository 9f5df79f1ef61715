"""The Memory section's sharded part: each rank's predicted peak under FSDP2 per world size for
the training shape (``results/memory/sharded.parquet``, probes.memory.sharded), the smallest
world size that fits the target (the shapes table's training row), and, where that is more than
one GPU, what to paste: the ``fsdp_config`` for ``TrainingArguments`` and the accelerate config
YAML (probes.dp.sharding, the same settings the data_parallel stage trains with).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.dp.sharding import accelerate_config, fsdp_config
from probes.report.sections.shared import records, stage_text

STAGE = "memory"
TABLE = "memory_sharded"
FITS = "fits"  # probes.memory.verdict.FITS (that module imports the fake-tensor machinery)
SMALLEST = "smallest_world_size"  # probes.memory.sharded.SMALLEST, on the training row
FITS_ON = "fits_on_gpus"  # probes.memory.sharded.FITS_ON
TRAINING = "training"  # probes.memory.shapes.TRAINING


def sharding_section(
    tables: Mapping[str, pd.DataFrame], jsons: Mapping[str, Any], not_run: Mapping[str, str]
) -> dict[str, Any]:
    """{"status": "ok", rows, smallest, words, paste} where the memory stage predicted FSDP2
    world sizes; {"status": "none"} otherwise (the stage did not run, or the training shape
    fits one GPU and no world size was asked for)."""
    sharded = tables.get(TABLE)
    if STAGE in not_run or sharded is None or sharded.empty:
        return {"status": "none"}
    summary = jsons.get("memory_summary") or {}
    rows = records(sharded.sort_values(["world_size", "reshard_after_forward"]),
                   table_columns(TABLE))  # fmt: skip
    for row in rows:
        reason = row.get("reason")
        row["reason"] = stage_text(reason, 160) if isinstance(reason, str) and reason else ""
    smallest, words = training_answer(tables.get("memory_shapes"))
    return {
        "status": "ok",
        "rows": rows,
        "smallest": smallest,
        "words": stage_text(words, 160) if words else "",
        "target": stage_text(summary.get("target", "target GPU")),
        "paste": paste(sharded, smallest, summary) if smallest and smallest > 1 else None,
    }


def training_answer(shapes: pd.DataFrame | None) -> tuple[int | None, str | None]:
    """The smallest world size that fits and its words, from the training row."""
    if shapes is None or SMALLEST not in shapes.columns:
        return None, None
    training = shapes[shapes["shape"] == TRAINING]
    if training.empty:
        return None, None
    row = training.iloc[0]
    smallest = row[SMALLEST]
    words = row.get(FITS_ON)
    return (None if pd.isna(smallest) else int(smallest)), (
        None if words is None or pd.isna(words) else str(words)
    )


def paste(sharded: pd.DataFrame, world_size: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """What to paste to train at ``world_size`` GPUs: resharding after forward where that fits
    (the least memory), else the setting that fits; the decoder layers as the memory stage read
    them from config.json."""
    fitting = sharded[(sharded["world_size"] == world_size) & (sharded["verdict"] == FITS)]
    reshard = bool(fitting["reshard_after_forward"].max()) if not fitting.empty else True
    layers = [str(v) for v in summary.get("layer_classes") or []]
    config = fsdp_config(layers, reshard)
    precision = "bf16" if summary.get("dtype") == "bfloat16" else "no"
    return {
        "world_size": world_size,
        "reshard_after_forward": reshard,
        "fsdp_config": repr(config),
        "training_arguments": f"TrainingArguments(..., fsdp=True, fsdp_config={config!r})",
        "accelerate_yaml": accelerate_config(world_size, layers, reshard, precision),
        "gradient_checkpointing": bool(summary.get("gradient_checkpointing")),
    }
