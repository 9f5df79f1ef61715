"""The "Summary" section: the measured changes in the order the report recommends them, the
failed controls and what did not run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.report.findings import recommendations
from probes.report.sections.controls import controls_section
from probes.report.sections.replay import measured_changes, replay_problem


def summary_section(
    inputs: Mapping[str, Any], scaling: Mapping[str, Any], mask: Mapping[str, Any], limit: int
) -> dict[str, Any]:
    """The Summary: changes ranked by the replay's measured saving with its 95% interval
    (``probes.report.sections.replay.measured_changes``), the fit's prediction beside each, and the
    changes that save memory rather than time. Without a replay the changes are listed
    unpriced: no fit or efficiency bracket stands in for a measurement."""
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    recs = recommendations(tables, jsons, not_run, limit=limit)
    problem = replay_problem(tables, not_run)
    measured = None if problem else measured_changes(tables, jsons, not_run)
    failed = [c for c in controls_section(jsons, not_run) if c["result"] == "FAILED"]
    return {
        "measured": measured,
        "replay_problem": problem,
        # without a replay: what the padding and bucket stages found, titles only, no saving
        "unpriced": [r for r in recs if r["kind"] == "time"] if problem else [],
        "memory": [r for r in recs if r["kind"] == "memory"],
        "not_run": dict(not_run),
        "failed_controls": failed,
    }
