"""The "Cross-entropy" section: the LM head + CE variants and their effects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.report.format import finite
from probes.report.sections.shared import not_run_section, records, stage_text

CE_ALL_UNCHUNKED = "all_positions_unchunked"


CE_LOSS_UNCHUNKED = "loss_positions_unchunked"


CE_LOSS_CHUNKED = "loss_positions_chunked"


def _effect(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict | None:
    """One change between two CE variants: both times, the time saved and after/before."""
    if before is None or after is None:
        return None
    t0, t1 = finite(before.get("time_s")), finite(after.get("time_s"))
    if t0 is None or t1 is None or t0 <= 0:
        return None
    return {"before_s": t0, "after_s": t1, "saved_s": t0 - t1, "ratio": t1 / t0}


def ce_effects(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict | None]:
    """The CE variants' two effects apart: position selection (all positions → loss positions,
    both unchunked) and chunking (loss positions unchunked → chunked). None where a variant
    did not run or failed (e.g. OOM)."""
    by_variant = {row["variant"]: row for row in rows if row.get("status") == "OK"}
    return {
        "position_selection": _effect(
            by_variant.get(CE_ALL_UNCHUNKED), by_variant.get(CE_LOSS_UNCHUNKED)
        ),
        "chunking": _effect(by_variant.get(CE_LOSS_UNCHUNKED), by_variant.get(CE_LOSS_CHUNKED)),
    }


def ce_section(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> dict[str, Any]:
    if "padding" in not_run:
        chunks = not_run_section(not_run["padding"])
    else:
        frame = tables["padding_ce_chunks"]
        chunks = {
            "status": "ok",
            "rows": records(frame, table_columns("padding_ce_chunks")),
            "budget_gib": finite(frame["budget_gib"].iloc[0]) if "budget_gib" in frame else None,
        }
    if "profile" in not_run:
        wall = not_run_section(not_run["profile"])
    else:
        rows = records(tables["profile_ce"], table_columns("profile_ce"))
        for row in rows:
            # the loss function each variant timed (stage-generated text, may carry its error)
            row["source"] = stage_text(row["source"], 160) if row["source"] else None
        wall = {"status": "ok", "rows": rows, "effects": ce_effects(rows)}
    return {"status": "ok", "chunks": chunks, "wall": wall}
