"""The "Bucketing" section: the sweep, its recommendation and packing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import PACKING, table_columns
from probes.report.format import finite
from probes.report.load import ReportInputError, diversity_level_name
from probes.report.sections.shared import not_run_section, records


def bucket_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "bucket" not in not_run and tables["bucket_summary"].empty:
        raise ReportInputError("bucket summary.parquet has no rows; rerun the bucket_sweep rule.")
    if "bucket" in not_run:
        return not_run_section(not_run["bucket"])
    rec = jsons["bucket_recommendation"]
    # mean over seeds per strategy x bucket size, in the report's order
    # (probes.bucket.sweep.summarise)
    summary = tables["bucket_summary"]
    packing = summary[summary["strategy"].str.startswith(PACKING)]
    recommended = rec.get("recommended") or {}
    thresholds = rec.get("thresholds") or {}
    return {
        "status": "ok",
        "rows": records(summary, table_columns("bucket_summary")),
        "n_seeds": int(summary["n_seeds"].max()),
        "level": diversity_level_name(rec),
        "result": str(rec.get("status", "")),
        "bucket_size": finite(recommended.get("bucket_size_batches")),
        "bucket_size_examples": finite(recommended.get("bucket_size_examples")),
        "how_to_use": recommended.get("how_to_use"),
        "hf_trainer_equivalent": recommended.get("hf_trainer_equivalent"),
        "gain_share": finite(thresholds.get("gain_share")),
        "min_diversity_share": finite(thresholds.get("min_diversity_share")),
        "gain_metric": thresholds.get("gain_metric"),
        "attention_note": rec.get("attention_note"),
        "packing": records(packing, table_columns("bucket_summary")),
    }
