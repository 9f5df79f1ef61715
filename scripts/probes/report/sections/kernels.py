"""The "Kernels" section: device kernel rows only, by category."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.report.sections.shared import not_run_section, records


def device_rows(kernels: pd.DataFrame, cpu_only: bool) -> pd.DataFrame:
    """Device kernel rows only: the ATen op and the kernel it launched carry the same time."""
    wanted = "CPU" if cpu_only else "CUDA"
    return kernels[kernels["device_type"].astype(str).str.upper() == wanted]


def kernels_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return not_run_section(not_run["profile"])
    cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
    kernels = device_rows(tables["profile_kernels"], cpu_only)
    kernels = kernels.sort_values("device_time_s", ascending=False)
    return {
        "status": "ok",
        "cpu_only": cpu_only,
        "rows": records(kernels, table_columns("profile_kernels")),
        "total_s": float(kernels["device_time_s"].sum()),
        "share_sum": float(kernels["share"].sum()),
        "dropped_rows": len(tables["profile_kernels"]) - len(kernels),
    }
