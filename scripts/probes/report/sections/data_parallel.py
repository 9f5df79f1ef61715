"""The Bucketing section's data-parallel table: per strategy and world size, the straggler overhead
and the slowest rank's saving against random (``probes.bucket.data_parallel``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.bucket import data_parallel as dp


def data_parallel_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    """{"status": "ok", "world_sizes", "configured", "metric", "rows": [{strategy, cells}]}, or
    status "not_run" (the bucket stage did not run or wrote no data-parallel table)."""
    table = tables.get("bucket_data_parallel")
    if "bucket" in not_run or table is None or table.empty:
        return {"status": "not_run", "reason": not_run.get("bucket", "no data_parallel table")}
    from probes.report.figures_dp import dp_lines

    rec = jsons["bucket_recommendation"]
    metric = str((rec.get("thresholds") or {}).get("gain_metric", "tokens"))
    size = (rec.get("recommended") or {}).get("bucket_size_batches")
    straggler, gain = dp.straggler_column(metric), dp.gain_column(metric)
    lines = dp_lines(table, size)
    worlds = sorted({int(w) for rows in lines.values() for w in rows["world_size"]})
    rows = []
    for strategy, frame in lines.items():
        by_w = frame.set_index("world_size")
        rows.append(
            {
                "strategy": strategy,
                "cells": [
                    {
                        "straggler": float(by_w.at[w, straggler]) if w in by_w.index else None,
                        "saving": float(by_w.at[w, gain]) if w in by_w.index else None,
                    }
                    for w in worlds
                ],
            }
        )
    return {
        "status": "ok",
        "world_sizes": worlds,
        "configured": int((rec.get("data_parallel") or {}).get("world_size", 1)),
        "metric": "padded tokens" if metric == "tokens" else "dense attention cost",
        "rows": rows,
    }
