"""The report's promised vs realized: the realize stage's table beside the replay's promise.

``results/realize/realized.parquet`` (``probes.realize.stage``) holds, for the baseline and each
change it checked, the realized epoch time and saving from real training steps (a simple random
sample of whole optimizer steps) with 95% intervals, the replay's promised ones, the verdict and
each phase's share of the difference. This module selects and labels those rows and reads each
change's verdict by the one three-way rule (``probes.realize.verdict.verdict_of``), so the report
and recommendations.json say the same word whatever two-way reading an older stage wrote.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.realize import verdict as vd
from probes.report.format import finite, fmt_pct
from probes.report.sections.replay import change_title, idle_examples

COLUMNS = table_columns("realize_realized")


def realize_section(
    tables: Mapping[str, pd.DataFrame], jsons: Mapping[str, Any], not_run: Mapping[str, str]
) -> dict[str, Any]:
    """{"status": "not_run", "reason"} or the rows (baseline first), the changes whose realized
    saving did not confirm the promise, and how the steps were sampled."""
    if "realize" in not_run:
        return {"status": "not_run", "reason": not_run["realize"]}
    frame = tables["realize_realized"]
    if frame.empty:
        return {"status": "not_run", "reason": "the realize stage checked no strategy"}
    recommended = (jsons["bucket_recommendation"].get("recommended") or {}) if jsons else {}
    idle = idle_examples(tables, not_run)
    summary = jsons.get("realize_summary") or {}
    agree_within = float(summary.get("agree_within") or 0.05)
    rows = []
    for record in frame[[c for c in COLUMNS if c in frame.columns]].to_dict(orient="records"):
        row = {
            k: (finite(v) if isinstance(v, int | float) and not isinstance(v, bool) else v)
            for k, v in record.items()
        }
        row["title"] = change_title(
            str(record["strategy"]),
            recommended.get("bucket_size_batches"),
            record.get("max_seq_len"),
            idle,
        )
        row["baseline"] = record["role"] == "baseline"
        row["wide_pp"] = wide_interval_pp(row, agree_within)
        if not row["baseline"]:
            row["verdict"] = vd.verdict_of(record, agree_within)
        rows.append(row)
    changes = [r for r in rows if not r["baseline"]]
    cpu_only = bool(frame["cpu_only"].fillna(False).astype(bool).any())
    by_word = {w: [r["title"] for r in changes if r["verdict"] == w] for w in vd.VERDICTS}
    return {
        "epoch_disagreement": epoch_disagreement(next((r for r in rows if r["baseline"]), None)),
        "status": "ok",
        "rows": rows,
        "rule": vd.rule_text(agree_within),
        "agrees": by_word[vd.AGREES],
        "undecided": by_word[vd.UNDECIDED],
        "disagrees": by_word[vd.DISAGREES],
        "disagrees_strategies": [r["strategy"] for r in changes if r["verdict"] == vd.DISAGREES],
        "checked": len(changes),
        # the Summary marks every other change it lists as not checked by real training steps
        "checked_titles": [r["title"] for r in changes],
        "by_strategy": {
            str(r["strategy"]): realized_check(r, cpu_only, agree_within) for r in changes
        },
        "cpu_only": cpu_only,
        "more_steps": more_steps_setting(cpu_only),
        "sample_steps": summary.get("sample_steps"),
        "agree_within_pp": 100 * agree_within,
    }


def more_steps_setting(cpu_only: bool) -> str:
    """The setting that buys the realize check more real steps (a narrower realized interval)."""
    return "realize.cpu_budget_s" if cpu_only else "realize.sample_steps"


def steps_to_decide(row: Mapping[str, Any], agree_within: float = 0.05) -> int | None:
    """Real steps per configuration that would narrow the realized interval to the rule's
    2 × agree_within (its width shrinking as 1/√n), or None where the row cannot tell."""
    low, high, n = (row.get(k) for k in ("realized_saving_ci_low", "realized_saving_ci_high",
                                          "sampled_steps"))  # fmt: skip
    values = [v for v in (low, high, n) if v is not None]
    if len(values) < 3 or not all(math.isfinite(float(v)) for v in values) or not n:
        return None
    width = float(high) - float(low)
    return max(math.ceil(float(n) * (width / (2 * agree_within)) ** 2), int(n) + 1)


def realized_check(
    row: Mapping[str, Any], cpu_only: bool, agree_within: float = 0.05
) -> dict[str, Any]:
    """One checked change as the first screen and recommendations.json carry it: the verdict, the
    realized saving with its interval, and what to do where the check could not decide."""
    saving, low, high = (
        row.get(k) for k in ("realized_saving", "realized_saving_ci_low", "realized_saving_ci_high")
    )
    text = f"{fmt_pct(saving)} [{fmt_pct(low)}, {fmt_pct(high)}]"
    action = None
    if row["verdict"] == vd.UNDECIDED and not vd.too_wide(low, high, agree_within):
        # the realized side can tell a 5 pp miss: the promise is what is too wide to check
        replay_key = "replay.cpu.budget_s" if cpu_only else "replay.budget_s"
        action = f"raise `{replay_key}` (the promise is too wide to check to the rule's width)"
    elif row["verdict"] == vd.UNDECIDED:
        needed = steps_to_decide(row, agree_within)
        action = f"raise `{more_steps_setting(cpu_only)}` (more real steps" + (
            f": about {needed} a configuration would decide it, {int(row['sampled_steps'])} now)"
            if needed
            else ")"
        )
    elif row["verdict"] == vd.DISAGREES:
        action = "do not rely on the promise: see what differed"
    return {
        "verdict": row["verdict"],
        "realized_saving": saving,
        "realized_saving_ci_low": low,
        "realized_saving_ci_high": high,
        "text": text,
        "differed": row.get("differed") or None,
        "next_action": action,
    }


def epoch_disagreement(baseline: Mapping[str, Any] | None) -> dict[str, float] | None:
    """The baseline's realized epoch against the promised one when their intervals do not
    overlap (realized / promised, as a ratio), else None: a saving compares like with like, an
    absolute epoch time does not survive a machine that ran slower during the real steps, or a
    per-step cost the replay does not time."""
    if not baseline:
        return None
    keys = ("realized_time_s", "realized_ci_low_s", "realized_ci_high_s")
    realized, low, high = (baseline.get(k) for k in keys)
    p_low, p_high = baseline.get("promised_ci_low_s"), baseline.get("promised_ci_high_s")
    promised = baseline.get("promised_time_s")
    values = (realized, low, high, p_low, p_high, promised)
    if any(v is None for v in values) or not promised:
        return None
    if low <= p_high and p_low <= high:
        return None
    return {"ratio": realized / promised}


def wide_interval_pp(row: Mapping[str, Any], agree_within: float) -> float | None:
    """A change's realized saving interval width in pp when it is wider than the ±agree_within
    band the verdict allows (twice it): such a check cannot tell a 5 pp miss from agreement, so an
    "agrees" on it is consistency, not confirmation; None when narrower (or the baseline)."""
    low, high = row.get("realized_saving_ci_low"), row.get("realized_saving_ci_high")
    if row.get("baseline") or low is None or high is None:
        return None
    width = 100 * (high - low)
    return width if width > 200 * agree_within else None
