"""What every section shares: contract-column records, the not-run marker, stage text."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from probes.report.format import label
from probes.report.load import NOT_RUN


def records(frame: pd.DataFrame, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Only the named columns (never anything else a stage wrote); absent optional ones → None."""
    present = [c for c in columns if c in frame.columns]
    rows = frame[present].to_dict(orient="records")
    for row in rows:
        for column in columns:
            value = row.setdefault(column, None)
            # NaN/NA means "not measured": None, so the template's `is not none` tests hold
            if value is pd.NA or (isinstance(value, float) and not math.isfinite(value)):
                row[column] = None
    return rows


def not_run_section(reason: str) -> dict[str, Any]:
    return {"status": NOT_RUN, "reason": reason}


def device_name(device: Any) -> str:
    if isinstance(device, Mapping):
        return str(device.get("name") or device.get("type") or "unknown")
    return str(device) if device else "unknown"


def stage_text(value: Any, limit: int = 100) -> str:
    """A message a stage generated (rules, violations): printable, short, safe in a cell."""
    return label(value, limit)


def timed_parts(described: Any) -> dict[str, str | None] | None:
    """What a timing stage ran, from its provenance (the step's ``describe()``): kind
    "trainer" with the user's Trainer class and factory spec, or kind "harness" with the
    harness's spec; None when nothing is recorded."""
    if not isinstance(described, Mapping):
        return None
    if described.get("kind") == "trainer" and described.get("trainer"):
        # what built it: the command (trainer.command) or the factory (probes.step.source)
        source = described.get("command") or described.get("factory")
        spec = source.get("spec") if isinstance(source, Mapping) else None
        return {"kind": "trainer", "name": str(described["trainer"]), "factory": spec}
    if described.get("spec"):
        return {"kind": "harness", "name": str(described["spec"]), "factory": None}
    return None
