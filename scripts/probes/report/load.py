"""The report's inputs: read every stage output, check it against the contract, note not-run stages.

The file names, columns and JSON keys come from ``probes.contracts`` (``TABLES``, ``JSONS``,
``report_inputs``); a file that does not follow them fails here with the file, what is missing and
the stage to rerun, before anything is rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from probes.contracts import JSONS, OPTIONAL_STAGES, TABLES, report_inputs
from probes.errors import ProbeError
from probes.io import read_json, read_parquet, read_provenance

NOT_RUN = "not_run"


class ReportInputError(ProbeError, ValueError):
    """A stage output the report cannot use; the message names the file, key and what to do."""


def not_run_reason(obj: Any) -> str | None:
    """The reason a stage did not run, from its JSON ({"status": "not_run", "reason": ...})."""
    if isinstance(obj, Mapping) and obj.get("status") == NOT_RUN:
        return str(obj.get("reason") or "no reason given")
    return None


def diversity_level_name(recommendation: Mapping[str, Any]) -> str:
    """The level the bucket stage judged diversity at (its summary's `diversity_rel_random`)."""
    level = (recommendation.get("thresholds") or {}).get("diversity_level", "step")
    return "micro-batch" if level == "micro_batch" else "optimizer step"


def check_columns(frame: pd.DataFrame, name: str, path: str | Path) -> pd.DataFrame:
    """Fail with the file, the missing columns and the section that needs them."""
    spec = TABLES[name]
    missing = [c for c in spec.required if c not in frame.columns]
    if missing:
        raise ReportInputError(
            f"{path}: column(s) {missing} missing; the report's {spec.section} section reads them "
            f"from the {spec.stage} stage (it wrote {sorted(map(str, frame.columns))}). Rerun the "
            f"stage, or update probes.contracts.TABLES['{name}'] if the column was renamed."
        )
    return frame


def check_keys(obj: Any, name: str, path: str | Path) -> Any:
    stage, required = JSONS[name]
    if not isinstance(obj, Mapping | list):
        raise ReportInputError(f"{path}: expected a JSON object from the {stage} stage.")
    if isinstance(obj, Mapping) and not_run_reason(obj) is None:
        missing = [k for k in required if k not in obj]
        if missing:
            raise ReportInputError(
                f"{path}: key(s) {missing} missing; the report reads them from the {stage} stage."
            )
    return obj


def load_inputs(paths: Mapping[str, str | Path]) -> dict[str, Any]:
    """Read every stage output named in `paths` (keys as in probes.contracts.report_inputs).

    Returns {"tables": {name: DataFrame}, "json": {name: obj}, "not_run": {stage: reason},
    "provenance": {stage: run_metadata of its first table}}. A stage whose JSON says
    status "not_run" gets empty tables and no column checks.
    """
    missing = set(report_inputs()) - set(paths)
    if missing:
        raise ReportInputError(f"report inputs missing: {sorted(missing)}")
    jsons: dict[str, Any] = {}
    # an optional stage that did not run under this config (e.g. data_parallel at world_size 1)
    skipped = {
        stage: reason
        for stage, (_, reason) in OPTIONAL_STAGES.items()
        if not any(key.startswith(f"{stage}_") for key in paths)
    }
    for name, (stage, _) in JSONS.items():
        if stage in skipped:
            jsons[name] = {"status": NOT_RUN, "reason": skipped[stage]}
            continue
        path = Path(paths[name])
        try:
            jsons[name] = read_json(path)
        except FileNotFoundError as err:
            raise ReportInputError(f"{path}: not found; run the {JSONS[name][0]} stage.") from err
        except json.JSONDecodeError as err:
            message = f"{path}: not valid JSON ({err.msg}, line {err.lineno})."
            raise ReportInputError(message) from err
        check_keys(jsons[name], name, path)
    not_run: dict[str, str] = {}
    for name, (stage, _) in JSONS.items():
        reason = not_run_reason(jsons[name])
        if reason and stage not in not_run:
            not_run[stage] = reason
    tables: dict[str, pd.DataFrame] = {}
    provenance: dict[str, dict[str, Any]] = {}
    for name, spec in TABLES.items():
        if spec.stage in skipped:
            tables[name] = pd.DataFrame(columns=list(spec.required))
            continue
        path = Path(paths[name])
        if not path.exists():
            raise ReportInputError(f"{path}: not found; run the {spec.stage} stage.")
        frame = read_parquet(path)
        if spec.stage not in not_run:
            check_columns(frame, name, path)
        tables[name] = frame
        provenance.setdefault(spec.stage, read_provenance(path))
    return {"tables": tables, "json": jsons, "not_run": not_run, "provenance": provenance}
