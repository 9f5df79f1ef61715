"""The report's first screen: one verdict table that answers on its own.

One row per recommended change (measured faster than random batches), in the Summary's order
(``probes.report.sections.replay.measured_changes``): the change in words, its settings in one line
(``probes.apply.document.settings_line``, from recommendations.json), the measured saving with its
95% interval, the realize check's three-way verdict with the realized saving
(``probes.report.sections.realize``), the memory verdict (``results/memory/changes.parquet``
when the memory stage ran, else "not predicted") and the next action where the answer is not
settled. Then
the device line (and whether the figures transfer), ties and disagreements, a sentence each.
Nothing here needs the method to be understood.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.apply.document import settings_line
from probes.realize import verdict as vd
from probes.report.format import finite, fmt_pct
from probes.report.sections.replay import CHANGE_STRATEGY
from probes.report.sections.shared import timed_parts

# the memory stage's table (probes.memory): key in the report's inputs, and its verdict words
MEMORY_TABLE = "memory_changes"
FITS, DOES_NOT_FIT, UNKNOWN = "fits", "does not fit", "unknown"
NOT_PREDICTED = "not predicted"
NOT_CHECKED = "not checked"
# a measured strategy that no recommendations.json change expresses (a global sort)
NO_SETTING = "no trainer setting in Apply it"


def memory_table(inputs: Mapping[str, Any]) -> pd.DataFrame | None:
    """The memory stage's per-change table; None when the stage did not run (memory.enabled
    false, or a contract from before the memory stage)."""
    frame = (inputs.get("tables") or {}).get(MEMORY_TABLE)
    if "memory" in inputs.get("not_run", {}) or not isinstance(frame, pd.DataFrame):
        return None
    return frame if not frame.empty and "strategy" in frame else None


def memory_target(jsons: Mapping[str, Any], not_run: Mapping[str, str]) -> str | None:
    """The GPU the memory stage predicted for ("H200, 139 GiB"), None when it did not run."""
    summary = jsons.get("memory_summary") if "memory" not in not_run else None
    if not isinstance(summary, Mapping) or not summary.get("target"):
        return None
    gib = finite(summary.get("target_gib"))
    return str(summary["target"]) + (f" ({gib:g} GiB)" if gib is not None else "")


def memory_check(frame: pd.DataFrame | None, strategy: str) -> dict[str, Any]:
    """One change's memory verdict: fits (with headroom), does not fit (with its peak), unknown
    (with the stage's reason), or not predicted (no memory table, or no row for the change)."""
    if frame is None:
        return {"verdict": NOT_PREDICTED, "text": NOT_PREDICTED}
    rows = frame[frame["strategy"].astype(str) == strategy]
    if rows.empty:
        return {"verdict": NOT_PREDICTED, "text": NOT_PREDICTED}
    row = rows.iloc[0]
    verdict = str(row.get("verdict") or UNKNOWN)
    peak, headroom = finite(row.get("predicted_peak_gib")), finite(row.get("headroom_gib"))
    if verdict == FITS:
        text = FITS + (f", {headroom:.1f} GiB headroom" if headroom is not None else "")
    elif verdict == DOES_NOT_FIT:
        text = "**does not fit**" + (f" (peak {peak:.1f} GiB)" if peak is not None else "")
    else:
        reason = str(row.get("reason") or "").strip()
        verdict, text = UNKNOWN, UNKNOWN + (f": {reason[:60]}" if reason else "")
    return {"verdict": verdict, "text": text, "peak_gib": peak, "headroom_gib": headroom}


def next_action(
    realized: Mapping[str, Any] | None,
    memory: Mapping[str, Any],
    realize_ok: bool,
    more_changes: str = "realize.max_changes",
) -> str | None:
    """What to do next for one change, or "apply it" where every check that ran is settled;
    `more_changes`: the setting that lets real steps check more changes."""
    if memory["verdict"] == DOES_NOT_FIT:
        return "do not apply as it is: it does not fit the target GPU"
    if realized is None:
        return None if not realize_ok else f"check it: raise `{more_changes}`"
    if realized.get("next_action"):
        return realized["next_action"]
    return "apply it"


def change_settings(document: Mapping[str, Any] | None) -> dict[str, str]:
    """Replayed strategy -> the settings of the recommendations.json change that measured it."""
    if not document:
        return {}
    baseline = document.get("baseline") or {}
    out = {}
    for change in document.get("changes") or []:
        strategy = CHANGE_STRATEGY.get(str(change.get("id")))
        if strategy is None and change.get("step_level"):
            strategy = str(change.get("id"))  # a step-level (or combined) change is its strategy
        if strategy and change.get("applies"):
            out[strategy] = settings_line(change, baseline)
    return out


def verdicts_section(
    measured: Mapping[str, Any] | None,
    realize: Mapping[str, Any],
    memory: pd.DataFrame | None,
    document: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The first screen's rows: every change the measurement recommends (faster than random),
    in the Summary's order; the measured changes it does not recommend, in words."""
    if not measured:
        return {"rows": [], "not_recommended": [], "memory_predicted": memory is not None}
    settings = change_settings(document)
    realize_ok = realize.get("status") == "ok"
    checked = realize.get("by_strategy") or {}
    more_changes = "realize.cpu_max_changes" if realize.get("cpu_only") else "realize.max_changes"
    rows, others = [], []
    for entry in measured["rows"]:
        strategy = entry["strategy"]
        if entry["baseline"] or entry["versus"] != "random batches":
            continue
        if entry["verdict"] != "faster":
            others.append({"title": entry["title"], "why": entry["verdict"]})
            continue
        realized = checked.get(strategy)
        mem = memory_check(memory, strategy)
        rows.append(
            {
                "strategy": strategy,
                "rank": entry["rank"],
                "tied": entry["tied"],
                "title": entry["title"],
                "settings": settings.get(strategy) or NO_SETTING,
                "saving": f"{fmt_pct(entry['saving'])} "
                f"[{fmt_pct(entry['saving_low'])}, {fmt_pct(entry['saving_high'])}]",
                "realized": realized_text(realized, realize),
                "memory": mem["text"],
                "next": next_action(realized, mem, realize_ok, more_changes) or "—",
            }
        )
    return {"rows": rows, "not_recommended": others, "memory_predicted": memory is not None}


def realized_text(realized: Mapping[str, Any] | None, realize: Mapping[str, Any]) -> str:
    """The realized cell: the verdict word and the realized saving, or why there is none."""
    if realize.get("status") != "ok":
        return "not run"
    if realized is None:
        return NOT_CHECKED
    word = realized["verdict"]
    shown = f"**{word}**" if word in (vd.DISAGREES, vd.UNDECIDED) else word
    return f"{shown}: {realized['text']}"


def trainer_settings(settings: Any) -> str:
    """The timed trainer's settings as it was built (TrainerStep.describe), unset ones left out:
    `per_device_train_batch_size=2, gradient_accumulation_steps=8, ...`."""
    if not isinstance(settings, Mapping):
        return ""
    return ", ".join(f"`{k}={v}`" for k, v in settings.items() if v is not None)


def timed_step(inputs: Mapping[str, Any]) -> str | None:
    """What was timed, from the realize summary's or the replay's provenance (``describe()`` of
    the step): the user's Trainer class and its factory, or the harness's spec; None unrecorded."""
    jsons, provenance = inputs.get("json") or {}, inputs.get("provenance") or {}
    for described in (
        (jsons.get("realize_summary") or {}).get("harness"),
        (provenance.get("replay") or {}).get("harness"),
    ):
        parts = timed_parts(described)
        if parts is None:
            continue
        if parts["kind"] == "harness":
            return f"the harness `{parts['name']}`"
        named = f"your `{parts['name']}`" + (
            f" from `{parts['factory']}`" if parts["factory"] else ""
        )
        settings = trainer_settings(described.get("settings"))
        return named + (f" at {settings}" if settings else "")
    return None


def device_line(
    scaling: Mapping[str, Any],
    measured: Mapping[str, Any] | None,
    realize: Mapping[str, Any],
    timed: str | None = None,
) -> dict[str, Any]:
    """Where the figures were measured, through what, and whether they transfer."""
    cpu_only = bool(
        (measured or {}).get("cpu_only")
        or realize.get("cpu_only")
        or (scaling.get("status") != "not_run" and scaling.get("cpu_only"))
    )
    device = scaling.get("device") if scaling.get("status") != "not_run" else None
    return {
        "cpu_only": cpu_only,
        "device": str(device) if device else ("CPU" if cpu_only else "an unrecorded device"),
        "dtype": scaling.get("dtype") if scaling.get("status") != "not_run" else None,
        "max_seq_len": (measured or {}).get("max_seq_len"),
        "timed": timed,
    }
