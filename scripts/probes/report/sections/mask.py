"""The "Mask gate" section: each scenario's layers, bands, fast path and backends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.report.format import finite, reason_code
from probes.report.sections.shared import not_run_section, stage_text


def fast_path(frame: pd.DataFrame) -> pd.Series:
    """A layer keeps SDPA's is_causal fast path: no explicit mask, is_causal set."""
    return (~frame["mask_present"].astype(bool)) & frame["is_causal"].astype(bool)


def _band(values: pd.Series) -> str:
    """The band of a group of layers: one value, a range, or "none" (no mask: is_causal)."""
    finite = pd.to_numeric(values, errors="coerce").dropna()
    if finite.empty:
        return "none"
    low, high = int(finite.min()), int(finite.max())
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"


def excluded_counts(excluded_by: pd.Series) -> str:
    """ "flash: reason; cudnn: reason" per layer, counted per distinct part over the layers."""
    parts = [
        part.strip()
        for text in excluded_by.dropna().astype(str)
        for part in text.split(";")
        if part.strip()
    ]
    counts = pd.Series(parts, dtype="object").value_counts()
    return "; ".join(f"{stage_text(k, 90)} ×{v}" for k, v in counts.head(4).items())


def mask_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "mask" in not_run:
        return not_run_section(not_run["mask"])
    layers = tables["mask_layers"].copy()
    # the stage's own fast_path column when it wrote one; the same definition otherwise
    if "fast_path" not in layers.columns:
        layers["fast_path"] = fast_path(layers)
    layers["fast_path"] = layers["fast_path"].fillna(False).astype(bool)
    violation = (
        layers["violation"] if "violation" in layers.columns else pd.Series(index=layers.index)
    )
    layers["has_violation"] = violation.notna() & (violation.astype(str) != "")
    scenarios = []
    for name, group in layers.groupby("scenario", sort=False):
        first = group.iloc[0]
        bands = (
            group.groupby("layer_type", sort=True)
            .agg(
                n=("layer_idx", "size"),
                fast=("fast_path", "sum"),
                lower=("band_lower", _band),
                upper=("band_upper", _band),
            )
            .reset_index()
            .to_dict(orient="records")
        )
        backends = group["backend"].dropna().astype(str).map(reason_code).value_counts()
        scenarios.append(
            {
                "scenario": name,
                "batch": first["batch"],
                "seq_len": first["seq_len"],
                "padding": first["padding"],
                "packed": bool(first["packed"]),
                "n_layers": len(group),
                "n_fast": int(group["fast_path"].sum()),
                "n_violations": int(group["has_violation"].sum()),
                "bands": bands,
                "backends": ", ".join(f"{k} ×{v}" for k, v in backends.items()),
                "excluded_by": excluded_counts(group["excluded_by"]),
            }
        )
    gate = jsons["mask_gate"]
    confirm = gate.get("confirm") or {}
    per_scenario = confirm.get("per_scenario") or {}
    for scenario in scenarios:
        counts = per_scenario.get(scenario["scenario"]) or {}
        scenario["confirmed"] = (
            f"{counts['agreed']}/{counts['total']} calls"
            if counts.get("total") is not None
            else "—"
        )
    target = gate.get("target") or {}
    violations = gate.get("violations") or []
    return {
        "status": "ok",
        "target": {
            "torch_version": stage_text(target.get("torch_version") or "unknown", 60),
            "compute_capability": stage_text(target.get("compute_capability") or "?", 10),
            "cudnn": stage_text(target.get("cudnn_version_source") or "unknown", 200),
            "order": " > ".join(str(b) for b in target.get("priority_order") or []) or "—",
        },
        "confirm_status": stage_text(confirm.get("status") or confirm.get("note") or "—", 80),
        "confirm_total": (
            f"{confirm['agreed']}/{confirm['total']}" if confirm.get("total") is not None else None
        ),
        "passed": bool(gate.get("passed")),
        "headline": gate.get("headline"),
        "violations_total": finite(gate.get("violations_total")) or len(violations),
        "violations": [stage_text(v, 160) for v in violations[:5]],
        "scenarios": scenarios,
    }
