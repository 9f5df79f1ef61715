"""The "Controls" section: every positive control, expected against observed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.contracts import STAGES
from probes.report.format import MISSING, fmt_value
from probes.report.load import not_run_reason


def check_values(expected: Any, observed: Any, limit: int = 3) -> tuple[str, str]:
    """A check's expected and observed values as short "key value" text for a table cell.

    A mapping shows its scalar entries; observed shows the keys expected names first (the
    numbers the check compares), else its first `limit` scalars, then a `hint` if it has one.
    The full values stay in the stage's control.json."""

    def scalar(value: Any) -> bool:
        return isinstance(value, bool | int | float | str) and not isinstance(value, dict)

    def text(key: str, value: Any) -> str:
        return f"{key} {fmt_value(value, 60)}"

    if not isinstance(expected, Mapping) or not isinstance(observed, Mapping):
        return fmt_value(expected), fmt_value(observed)
    exp = [(k, v) for k, v in expected.items() if scalar(v)][: limit + 1]
    shared = [(k, observed[k]) for k, _ in exp if k in observed and scalar(observed[k])]
    obs = shared or [(k, v) for k, v in observed.items() if scalar(v) and k != "hint"][:limit]
    if isinstance(observed.get("hint"), str):
        obs.append(("hint:", observed["hint"]))
    return (
        "; ".join(text(k, v) for k, v in exp) or fmt_value(expected),
        "; ".join(text(k, v) for k, v in obs) or fmt_value(observed),
    )


UNINFORMATIVE = "uninformative"


def check_result(check: Mapping[str, Any]) -> str:
    """passed, FAILED, or uninformative (a check that could not fail at the width the run had:
    the replay's coverage control over intervals wider than replay.max_width)."""
    if check.get("verdict") == UNINFORMATIVE:
        return UNINFORMATIVE
    return "passed" if check.get("passed") is True else "FAILED"


def controls_section(jsons: Mapping[str, Any], not_run: Mapping[str, str]) -> list[dict]:
    """Every probe's positive control and its result; a control made of checks lists each."""
    rows = []
    for stage in STAGES:
        entry = jsons[f"{stage}_control"]
        # a stage that did not run may still write a control with passed: null
        reason = not_run_reason(entry)
        if reason is None and stage in not_run and entry.get("passed") is None:
            reason = not_run[stage]
        if reason:
            rows.append(
                {
                    "stage": stage,
                    "name": entry.get("name", MISSING),
                    "description": reason,
                    "expected": None,
                    "observed": None,
                    "result": "not run",
                    "checks": [],
                }
            )
            continue
        checks = [
            {
                "name": check.get("name", MISSING),
                **dict(
                    zip(
                        ("expected", "observed"),
                        check_values(check.get("expected"), check.get("observed")),
                        strict=True,
                    )
                ),
                "result": check_result(check),
            }
            for check in entry.get("checks") or []
            if isinstance(check, Mapping)
        ]
        n_passed = sum(c["result"] == "passed" for c in checks)
        rows.append(
            {
                "stage": stage,
                "name": entry["name"],
                "description": entry["description"],
                # a control made of many checks: the counts here, each check on its own row
                "expected": f"{len(checks)} checks pass" if checks else entry["expected"],
                "observed": f"{n_passed} of {len(checks)} pass" if checks else entry["observed"],
                "result": "passed" if entry["passed"] is True else "FAILED",
                "checks": checks,
            }
        )
    return rows
