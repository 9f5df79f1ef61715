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
from probes.report.sections.verdicts import DOES_NOT_FIT


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
    share_caveats(changes)
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
    """A change's memory verdict in words: recommendations.json's `memory`, whose text the first
    screen's memory column wrote (verdicts.memory_check, the one home of these words)."""
    memory = memory or {}
    said = str(memory.get("text") or memory.get("verdict") or "not predicted")
    return f"{said}: do not apply it as it is" if memory.get("verdict") == DOES_NOT_FIT else said


def caveat_clauses(caveat: Any) -> list[str]:
    """A change's caveat (recommendations.json: clauses joined by "; ") as its clauses; a "; "
    inside parentheses stays in its clause."""
    clauses, depth, start, text = [], 0, 0, str(caveat or "")
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and text.startswith("; ", i):
            clauses.append(text[start:i])
            start = i + 2
    clauses.append(text[start:])
    return [c.strip() for c in clauses if c.strip()]


def share_caveats(changes: list[dict[str, Any]]) -> None:
    """Each caveat once: a clause several changes carry is written in full under the first of
    them, labelled A, B, ..., and the others refer to it by label and change number (1-based, as
    Apply it numbers them). Sets `caveats` (own clauses) and `shared_caveats` on each entry."""
    holders: dict[str, list[int]] = {}
    clauses = [caveat_clauses(entry.get("caveat")) for entry in changes]
    for number, own in enumerate(clauses, 1):
        for clause in dict.fromkeys(own):
            holders.setdefault(clause, []).append(number)
    shared = [clause for clause, numbers in holders.items() if len(numbers) > 1]
    labels = {clause: chr(ord("A") + i % 26) * (1 + i // 26) for i, clause in enumerate(shared)}
    for number, (entry, own) in enumerate(zip(changes, clauses, strict=True), 1):
        entry["caveats"] = [c for c in own if c not in labels]
        entry["shared_caveats"] = [
            {
                "label": labels[clause],
                "text": clause,
                "here": holders[clause][0] == number,
                "first": holders[clause][0],
                "others": [n for n in holders[clause] if n != number],
            }
            for clause in dict.fromkeys(own)
            if clause in labels
        ]
