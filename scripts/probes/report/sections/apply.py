"""The report's "Apply it" section: each change of ``recommendations.json`` with its snippets,
verification and the saving the replay measured for it (none where it did not: no estimate)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.report.format import finite
from probes.report.load import not_run_reason
from probes.report.sections.replay import change_measurement, tokens_not_time
from probes.report.sections.shared import not_run_section, stage_text


def apply_section(
    document: Mapping[str, Any] | None,
    tables: Mapping[str, pd.DataFrame],
    not_run: Mapping[str, str],
) -> dict[str, Any]:
    """ "Apply it": each change of ``recommendations.json`` (probes.apply.document) with its
    snippets,
    the libraries they were verified against, tokens per update, the caveat and its saving:
    measured where the replay measured that change (``report_replay.change_measurement``),
    else none: no estimate stands in for a measurement.
    """
    if document is None:
        return not_run_section("no recommendations document was built")
    reason = not_run_reason(document)
    if reason:
        return not_run_section(reason)
    # Measure the decision: a change the replay did not time gets no price at all
    replayed = "replay" not in not_run and not tables.get("replay_estimates", pd.DataFrame()).empty
    changes, skipped = [], []
    for change in document.get("changes") or []:
        if not change.get("applies"):
            skipped.append({"id": change.get("id"), "reason": stage_text(change.get("reason"))})
            continue
        changes.append(change_entry(change, tables, not_run))
    baseline = document.get("baseline") or {}
    return {
        "status": "ok",
        "replayed": replayed,
        "libraries": library_versions(document),
        "baseline": {
            "micro_batch_size": baseline.get("micro_batch_size"),
            "grad_accum": baseline.get("grad_accum"),
            "tokens_per_update": finite(baseline.get("tokens_per_update")),
        },
        "changes": changes,
        "skipped": skipped,
    }


def library_versions(document: Mapping[str, Any]) -> dict[str, str]:
    """Each library the snippets were verified against: its version, or why it is missing."""
    return {
        name: info.get("version") or f"not installed ({stage_text(info.get('reason'), 80)})"
        for name, info in (document.get("libraries") or {}).items()
        if isinstance(info, Mapping)
    }


def change_entry(
    change: Mapping[str, Any], tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]
) -> dict[str, Any]:
    """One change that applies, as the section shows it, with the replay's measured saving."""
    tokens = change.get("tokens_per_update") or {}
    entry = {
        "id": change["id"],
        "title": change.get("title"),
        "how": change.get("how"),
        "snippets": {
            library: snippet["text"]
            for library, snippet in (change.get("snippets") or {}).items()
            if isinstance(snippet, Mapping) and snippet.get("text")
        },
        "verification": {
            library: {
                "verified": result.get("verified"),
                "reason": stage_text(result.get("reason"), 160),
            }
            for library, result in (change.get("verification") or {}).items()
        },
        "saving": change_measurement(change, tables, not_run),
        # the report's order and decision (probes.apply.document.order_changes)
        "rank": change.get("rank"),
        "tied": bool(change.get("tied")),
        "decision": change.get("decision"),
        "recommended": bool(change.get("recommended")),
        "tokens_before": finite(tokens.get("before")),
        "tokens_after": finite(tokens.get("after")),
        "tokens_how": tokens.get("how"),
        "caveat": change.get("caveat"),
        # the first screen's checks (probes.apply.document.with_checks)
        "settings_line": change.get("settings_line"),
        "realized": change.get("realized") or {"verdict": None, "status": "not checked"},
        "memory": memory_text(change.get("memory")),
    }
    entry["tokens_not_time"] = (
        None
        if entry["recommended"] or entry["saving"] is None
        else tokens_not_time(entry["saving"], str(entry["decision"] or ""))
    )
    return entry


def memory_text(memory: Mapping[str, Any] | None) -> str:
    """A change's memory verdict in words (recommendations.json's `memory`)."""
    memory = memory or {}
    verdict = str(memory.get("verdict") or "not predicted")
    peak, headroom = finite(memory.get("peak_gib")), finite(memory.get("headroom_gib"))
    if verdict == "fits" and headroom is not None:
        return f"fits, {headroom:.1f} GiB headroom"
    if verdict == "does not fit" and peak is not None:
        return f"**does not fit** (peak {peak:.1f} GiB): do not apply it as it is"
    return verdict
