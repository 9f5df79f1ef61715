"""The memory stage's outputs as the stage writes them, for tests that stub the stage.

`write_memory_stage(paths)` takes the report's keys (`memory_shapes`, `memory_changes`, ...: as in
probes.contracts.optional_report_inputs) and writes a small, valid set: tests/stage_fixtures.py's
`write_stage("memory", ...)` can call it, so the report's workflow test stubs this stage too.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from probes.io import run_metadata, write_json, write_parquet

SHAPES = [
    # shape, strategy, rows, length, layout, peak, verdict, reason
    ("training", "", 2, 4096, "padded", 12.7, "fits", ""),
    ("random", "random", 2, 4096, "padded", 12.4, "fits", ""),
    ("packing", "packing", 1, 8192, "packed", 150.2, "does not fit",
     "turn on gradient checkpointing (profile.harness_options)"),
]  # fmt: skip


def shapes_frame(target_gib: float = 139.0) -> pd.DataFrame:
    rows = []
    for shape, strategy, n, length, layout, peak, verdict, reason in SHAPES:
        rows.append(
            {
                "shape": shape,
                "strategy": strategy,
                "rows": n,
                "length": length,
                "layout": layout,
                "target_gib": target_gib,
                "parameters_gib": 0.5,
                "gradients_gib": 0.01,
                "optimizer_state_gib": 0.03,
                "activations_gib": peak - 0.54,
                "predicted_peak_gib": peak,
                "headroom_gib": target_gib - peak,
                "verdict": verdict,
                "reason": reason,
                "assumptions": "attention: fused SDPA",
            }  # fmt: skip
        )
    return pd.DataFrame(rows)


def write_memory_stage(paths: dict[str, Path]) -> None:
    meta = run_metadata({"fixture": True})
    shapes = shapes_frame()
    write_parquet(shapes, paths["memory_shapes"], meta)
    changes = shapes.rename(columns={"rows": "shape_rows", "length": "shape_length"})
    changes.loc[changes["strategy"] == "", "strategy"] = "training"
    columns = ["strategy", "shape_rows", "shape_length", "layout", "predicted_peak_gib",
               "headroom_gib", "verdict", "reason"]  # fmt: skip
    write_parquet(changes[columns], paths["memory_changes"], meta)
    fit = pd.DataFrame(
        [{"length_kind": "max_seq_len", "length": 4096, "rows_per_update": 16,
          "max_micro_batch_size": 16, "grad_accum": 1, "predicted_peak_gib": 76.9,
          "method": "affine in rows"}]
    )  # fmt: skip
    write_parquet(fit, paths["memory_fit"], meta)
    if "memory_sharded" in paths:  # each rank's peak under FSDP2 for the training shape
        sharded = pd.DataFrame(
            [{"shape": "training", "strategy": "fsdp2", "world_size": w,
              "reshard_after_forward": True, "rows": 2, "length": 4096, "target_gib": 139.0,
              "predicted_peak_gib": peak, "headroom_gib": 139.0 - peak, "verdict": "fits",
              "reason": ""} for w, peak in ((1, 13.0), (2, 12.8))]
        )  # fmt: skip
        write_parquet(sharded, paths["memory_sharded"], meta)
    write_json({"target_gib": 139, "target": "H200", "dtype": "bfloat16",
                "gradient_checkpointing": False}, paths["memory_summary"])  # fmt: skip
    check = {"name": "known_model", "description": "by hand", "expected": 1, "observed": 1,
             "passed": True}  # fmt: skip
    write_json({**check, "name": "memory_controls", "checks": [check]}, paths["memory_control"])
