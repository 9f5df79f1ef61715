"""The report's first screen: one table that answers on its own.

One row per change the replay's table holds (``results/profile/replay.parquet``, read through
``probes.report.sections.replay.measured_changes``), in its order: rank (a tie shares it), then
measured saving. Each row: the change in words, the measured saving with its 95% interval, the
decision (faster / slower / tie / not timed here, and why briefly), the realize check's three-way
verdict (``probes.report.sections.realize``) and the memory verdict
(``results/memory/changes.parquet`` when the memory stage ran, else "not predicted"). A change
that saves memory rather than time (the CE chunking) closes the table. Under it the template
writes at most five lines: the device and what was timed, the power line, the mask gate and the
controls. Settings and caveats are in "Apply it"; nothing here needs the method.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.realize import verdict as vd
from probes.realize.scope import never_checked
from probes.report.format import finite, fmt_bytes, fmt_count, fmt_pct, fmt_seconds
from probes.report.sections.shared import timed_parts
from probes.step import combined as cb

# the memory stage's table (probes.memory): key in the report's inputs, and its verdict words
MEMORY_TABLE = "memory_changes"
FITS, DOES_NOT_FIT, UNKNOWN = "fits", "does not fit", "unknown"
NOT_PREDICTED = "not predicted"
NOT_CHECKED = "not checked"


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
    (with the stage's reason), or not predicted (no memory table, or no row for the change; a
    combined change the memory stage did not see is judged by its parts: combined_memory)."""
    if frame is None:
        return {"verdict": NOT_PREDICTED, "text": NOT_PREDICTED}
    rows = frame[frame["strategy"].astype(str) == strategy]
    if rows.empty:
        if cb.is_combined(strategy):
            parsed = cb.parse(strategy)
            names = [parsed.batching, *parsed.steps]
            return combined_memory(names, [memory_check(frame, n) for n in names])
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


def combined_memory(names: list[str], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A combined change's memory from its parts' (the memory stage predicts each change alone,
    before the replay chooses the combination): a part that does not fit makes it not fit as far
    as predicted (never recommended as it is); parts that all fit leave it not predicted, with
    the largest part's peak for scale."""
    missing = [n for n, p in zip(names, parts, strict=True) if p["verdict"] == DOES_NOT_FIT]
    if missing:
        peak = max(finite(p.get("peak_gib")) or 0.0 for p in parts)
        text = f"**does not fit** as predicted: its part {missing[0]} does not"
        return {"verdict": DOES_NOT_FIT, "text": text, "peak_gib": peak, "headroom_gib": None}
    peaks = [finite(p.get("peak_gib")) for p in parts]
    if all(p["verdict"] == FITS for p in parts) and all(v is not None for v in peaks):
        text = f"{NOT_PREDICTED} together; each part fits (largest peak {max(peaks):.1f} GiB)"
        return {"verdict": NOT_PREDICTED, "text": text}
    return {"verdict": NOT_PREDICTED, "text": NOT_PREDICTED}


def next_action(
    realized: Mapping[str, Any] | None,
    memory: Mapping[str, Any],
    realize_ok: bool,
    more_changes: str = "realize.max_changes",
    unchecked: str | None = None,
) -> str | None:
    """What to do next for one change, or "apply it" where every check that ran is settled;
    `more_changes`: the setting that lets real steps check more changes; `unchecked`: why
    realize never checks this change (probes.realize.scope), said instead of asking for more."""
    if memory["verdict"] == DOES_NOT_FIT:
        return "do not apply as it is: it does not fit the target GPU"
    if realized is None:
        if not realize_ok:
            return None
        return unchecked or f"check it: raise `{more_changes}`"
    if realized.get("next_action"):
        return realized["next_action"]
    return "apply it"


def verdicts_section(
    measured: Mapping[str, Any] | None,
    realize: Mapping[str, Any],
    memory: pd.DataFrame | None,
    memory_only: list[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The first screen's table: every change the replay's table holds, in its order (rank, then
    measured saving; a tie shares its rank), the baseline among them; then the changes it did not
    time; then the changes that save memory rather than time (`memory_only`, the CE chunking)."""
    memory_predicted = memory is not None
    if not measured:
        return {
            "rows": [],
            "memory_predicted": memory_predicted,
            "faster": 0,
            "timed": 0,
            "best": None,
        }
    realize_ok = realize.get("status") == "ok"
    checked = realize.get("by_strategy") or {}
    more = "realize.cpu_max_changes" if realize.get("cpu_only") else "realize.max_changes"
    rows = []
    for entry in measured["rows"]:
        baseline = bool(entry["baseline"])
        realized, mem = checked.get(entry["strategy"]), memory_check(memory, entry["strategy"])
        decision = decision_word(entry)
        unchecked = never_checked(entry["strategy"])
        action = (
            next_action(realized, mem, realize_ok, more, unchecked)
            if decision == "faster"
            else None
        )
        rows.append(
            {
                "strategy": entry["strategy"],
                "rank": "—" if entry["rank"] is None else fmt_count(entry["rank"]),
                "title": entry["title"],
                "saving": "0% (baseline)" if baseline else saving_text(entry),
                # a settled faster change needs no next step; an unsettled one says which
                "decision": decision if action in (None, "apply it") else f"{decision}; {action}",
                "realized": "—" if baseline else realized_text(realized, realize),
                "memory": mem["text"],
            }
        )
    for entry in measured["not_recommended"]:
        rows.append(
            {
                "strategy": entry["strategy"],
                "rank": "—",
                "title": entry["title"],
                "saving": "—",
                "decision": not_timed_word(entry.get("reason")),
                "realized": NOT_CHECKED if realize_ok else "not run",
                "memory": memory_check(memory, entry["strategy"])["text"],
            }
        )
    rows += [memory_only_row(rec) for rec in memory_only or []]
    timed = [r for r in measured["rows"] if not r["baseline"] and r["versus"] == "random batches"]
    return {
        "rows": rows,
        "memory_predicted": memory_predicted,
        "faster": sum(r["verdict"] == "faster" for r in timed),
        "best": next((r["title"] for r in timed if r["verdict"] == "faster"), None),
        "timed": len(timed),
    }


def memory_only_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A change that saves memory rather than time (probes.report.findings.ce_chunk_finding):
    the replay does not time it, so its row says what it saves instead."""
    saved = fmt_bytes(rec.get("memory_before"))
    if rec.get("memory_after") is not None:
        saved += f" → {fmt_bytes(rec['memory_after'])}"
    return {
        "strategy": None,
        "rank": "—",
        "title": rec["title"],
        "saving": "—",
        "decision": f"not timed here (saves loss memory, {saved}, not time)",
        "realized": "—",
        "memory": "—",
    }


def saving_text(entry: Mapping[str, Any]) -> str:
    """The measured saving with its 95% interval, or "not measured"."""
    if entry.get("saving") is None:
        return "not measured"
    low, high = fmt_pct(entry["saving_low"]), fmt_pct(entry["saving_high"])
    return f"{fmt_pct(entry['saving'])} [{low}, {high}]"


def decision_word(entry: Mapping[str, Any]) -> str:
    """faster / slower / tie (its interval includes 0) for a change measured against random
    batches; a saving against another baseline (padding to max_seq_len) says which."""
    verdict = str(entry["verdict"])
    if entry["baseline"]:
        return "baseline"
    if verdict == "not measured":
        return "not timed here (no interval)"
    word = "faster" if verdict == "faster" else "slower" if verdict.startswith("slower") else "tie"
    if entry.get("versus") != "random batches":
        return f"{word} {'with' if word == 'tie' else 'than'} {entry['versus']}"
    return word


# the replay's reasons for a change it left out (probes.replay.strata.affordable_changes), briefly
_BELOW_RESOLUTION = re.compile(r"saving (-?[\d.]+%) is below what timing resolves.*\(±([\d.]+%)\)")
_BUDGET = re.compile(r"would take about ([\d.e+]+) s")


def not_timed_word(reason: Any) -> str:
    """The decision of a change the replay left out, "not timed here (why, briefly)", from its
    invalid_reason: a change its budget
    left out, one whose exact saving is below what timing resolves, or another reason cut to
    its first clause (the full text is under the change in Apply it)."""
    text = str(reason or "").strip()
    below, budget = _BELOW_RESOLUTION.search(text), _BUDGET.search(text)
    if below:
        why = f"exact token saving {below[1]}, below the ±{below[2]} timing resolves"
    elif budget:
        why = f"the budget: about {fmt_seconds(float(budget[1]))} more would decide it"
    else:
        why = re.split(r"[;:(]", text.removeprefix("not timed:").strip(), maxsplit=1)[0].strip()
        why = (why[:57] + "…" if len(why) > 58 else why) or "no reason recorded"
    timed = text.startswith("not timed") or not text
    return f"{'not timed' if timed else 'not valid'} here ({why})"


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
        "recorded": bool(device),
        "dtype": scaling.get("dtype") if scaling.get("status") != "not_run" else None,
        "max_seq_len": (measured or {}).get("max_seq_len"),
        "timed": timed,
    }


def beside_view(provenance: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """What the replay priced beside its table (its provenance's "compile" and "optim", from
    probes.replay.step_changes.priced_beside), one entry each: the name, the saving as a share
    of the run (compile) or of a training step (optim) with its 95% interval, and what else it
    says (break-even steps, memory, why it is not recommended); then each change it did not
    time on this device, with the one line saying why (its "not_measured": torch_compile where
    replay.compile is off, the GPU-only loss kernels on a CPU)."""
    out: list[dict[str, Any]] = []
    provenance = provenance or {}
    for name, record in sorted((provenance.get("compile") or {}).items()):
        out.append(
            {
                "name": name,
                "of": "the run, compile included",
                "saving": record.get("saving"),
                "low": record.get("saving_low"),
                "high": record.get("saving_high"),
                "note": record.get("why") or compile_note(record),
            }
        )
    for name, record in sorted((provenance.get("optim") or {}).items()):
        out.append(
            {
                "name": name,
                "of": f"a training step, against `{record.get('against')}`",
                "saving": record.get("saving"),
                "low": record.get("saving_low"),
                "high": record.get("saving_high"),
                "note": record.get("memory"),
            }
        )
    listed = {entry["name"] for entry in out}
    for name, why in sorted((provenance.get("not_measured") or {}).items()):
        if name not in listed:
            out.append({"name": name, "of": None, "saving": None, "low": None, "high": None,
                        "note": str(why)})  # fmt: skip
    return out


def compile_note(record: Mapping[str, Any]) -> str | None:
    """A priced compile's break-even step count and its memory verdict, as far as recorded."""
    parts = []
    if record.get("break_even_steps") is not None:
        parts.append(f"break-even after {record['break_even_steps']:.0f} steps")
    if record.get("memory"):
        parts.append(f"memory {record['memory']}")
    return "; ".join(parts) or None
