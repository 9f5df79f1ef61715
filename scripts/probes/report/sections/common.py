"""The report's sections: one builder per section of the template, and what they share.

Each builder returns plain dicts and lists for the template, {"status": "not_run", "reason": ...}
when the stage behind it did not run. Rows carry only the contract's columns (``_records``), so no
column a stage wrote outside ``probes.contracts.TABLES`` is ever rendered. The profile's sections
are in ``probes.report.sections.profile``, "Apply it" in ``probes.report.sections.apply``;
``probes.report.render``
assembles them all (``build_context``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from probes.contracts import PACKING, STAGES, STATUSES, TRAINING_STATUSES, table_columns
from probes.report.findings import recommendations, waste_table
from probes.report.format import MISSING, finite, fmt_value, label, reason_code
from probes.report.load import NOT_RUN, ReportInputError, diversity_level_name, not_run_reason
from probes.report.sections.replay import measured_changes, replay_problem

OTHER_SOURCES = "(other)"  # the padding stage pools sources beyond its limit under this label
DISTRIBUTION_STATS = ("count", "tokens", "p50", "p90", "p99", "max")


def _records(frame: pd.DataFrame, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Only the named columns (never anything else a stage wrote); absent optional ones → None."""
    present = [c for c in columns if c in frame.columns]
    rows = frame[present].to_dict(orient="records")
    for row in rows:
        for column in columns:
            value = row.setdefault(column, None)
            # NaN/NA means "not measured": None, so the template's `is not none` tests hold
            if value is pd.NA or (isinstance(value, float) and not math.isfinite(value)):
                row[column] = None
    return rows


def _not_run(reason: str) -> dict[str, Any]:
    return {"status": NOT_RUN, "reason": reason}


def _device_name(device: Any) -> str:
    if isinstance(device, Mapping):
        return str(device.get("name") or device.get("type") or "unknown")
    return str(device) if device else "unknown"


def distribution_rows(distribution: pd.DataFrame, top_sources: int) -> tuple[list[dict], int]:
    """Per-source statistics of tokens per example: overall first, then the largest sources."""
    stats = distribution[(distribution["kind"] == "stat") & (distribution["measure"] == "n_tokens")]
    wide = stats.pivot_table(
        index=["scope", "source"], columns="statistic", values="value", aggfunc="first", sort=False
    ).reset_index()
    for column in DISTRIBUTION_STATS:
        if column not in wide.columns:
            wide[column] = None
    wide["_overall"] = wide["scope"] != "overall"
    wide["_other"] = wide["source"] == OTHER_SOURCES
    wide = wide.sort_values(["_overall", "_other", "count"], ascending=[True, True, False])
    shown = wide.head(top_sources + 1)
    return shown[["scope", "source", *DISTRIBUTION_STATS]].to_dict(orient="records"), max(
        0, len(wide) - len(shown)
    )


def padding_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], top_sources: int
) -> dict[str, Any]:
    if "padding" in not_run:
        return _not_run(not_run["padding"])
    lengths, summary = tables["padding_lengths"], tables["padding_summary"]
    unknown = sorted(set(lengths["status"]) - set(STATUSES))
    if unknown:
        raise ReportInputError(
            f"padding lengths: unknown status value(s) {unknown}; expected {list(STATUSES)}."
        )
    status_rows = summary[summary["section"] == "status"]
    counts = status_rows[status_rows["metric"] == "count"].set_index("status")["value"]
    lost = status_rows[status_rows["metric"].isin(["tokens_lost", "loss_tokens_lost"])]
    by_source = lengths.groupby(["source", "status"]).size().unstack(fill_value=0)
    by_source = by_source.reindex(columns=list(STATUSES), fill_value=0)
    by_source["total"] = by_source.sum(axis=1)
    by_source = by_source.sort_values("total", ascending=False)
    reasons = summary[summary["section"] == "reason"].assign(
        code=lambda f: f["reason"].map(reason_code)
    )
    reasons = (
        reasons.groupby(["status", "code"], sort=False)["value"]
        .sum()
        .reset_index()
        .sort_values("value", ascending=False)
        .head(10)
    )
    distribution, more = distribution_rows(tables["padding_distribution"], top_sources)
    trains = lengths["status"].isin(TRAINING_STATUSES)
    return {
        "status": "ok",
        "counts": {s: int(counts.get(s, 0)) for s in STATUSES},
        "lost": {r["metric"]: r["value"] for r in lost.to_dict(orient="records")},
        "n_examples": len(lengths),
        "n_sources": int(lengths["source"].nunique()),
        "status_by_source": [
            {"source": src, **{k: int(v) for k, v in row.items()}}
            for src, row in by_source.head(top_sources).iterrows()
        ],
        "more_sources": max(0, len(by_source) - top_sources),
        "reasons": reasons.to_dict(orient="records"),
        "distribution": distribution,
        "more_distribution_rows": more,
        "waste": waste_table(summary).to_dict(orient="records"),
        "train_tokens": float(lengths.loc[trains, "n_tokens"].sum()),
        "loss_tokens": float(lengths.loc[trains, "n_loss_tokens"].sum()),
    }


def bucket_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "bucket" not in not_run and tables["bucket_summary"].empty:
        raise ReportInputError("bucket summary.parquet has no rows; rerun the bucket_sweep rule.")
    if "bucket" in not_run:
        return _not_run(not_run["bucket"])
    rec = jsons["bucket_recommendation"]
    # mean over seeds per strategy x bucket size, in the report's order
    # (probes.bucket.sweep.summarise)
    summary = tables["bucket_summary"]
    packing = summary[summary["strategy"].str.startswith(PACKING)]
    recommended = rec.get("recommended") or {}
    thresholds = rec.get("thresholds") or {}
    return {
        "status": "ok",
        "rows": _records(summary, table_columns("bucket_summary")),
        "n_seeds": int(summary["n_seeds"].max()),
        "level": diversity_level_name(rec),
        "result": str(rec.get("status", "")),
        "bucket_size": finite(recommended.get("bucket_size_batches")),
        "bucket_size_examples": finite(recommended.get("bucket_size_examples")),
        "how_to_use": recommended.get("how_to_use"),
        "hf_trainer_equivalent": recommended.get("hf_trainer_equivalent"),
        "gain_share": finite(thresholds.get("gain_share")),
        "min_diversity_share": finite(thresholds.get("min_diversity_share")),
        "gain_metric": thresholds.get("gain_metric"),
        "attention_note": rec.get("attention_note"),
        "packing": _records(packing, table_columns("bucket_summary")),
    }


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


def stage_text(value: Any, limit: int = 100) -> str:
    """A message a stage generated (rules, violations): printable, short, safe in a cell."""
    return label(value, limit)


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
        return _not_run(not_run["mask"])
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
                "result": "passed" if check.get("passed") is True else "FAILED",
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


def provenance_section(
    provenance: Mapping[str, Mapping[str, Any]],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    report_meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Config hash, commit, date and command line per stage, with a warning when they differ."""
    stages = []
    for stage in STAGES:
        meta = provenance.get(stage) or {}
        stages.append(
            {
                "stage": stage,
                "status": "not run" if stage in not_run else "ran",
                "config_hash": meta.get("config_hash", MISSING),
                "git_commit": meta.get("git_commit", MISSING),
                "date": meta.get("date", MISSING),
                "command_line": meta.get("command_line", MISSING),
            }
        )
    hashes = {s["config_hash"] for s in stages if s["config_hash"] != MISSING}
    versions = dict(report_meta.get("versions") or {})
    differing = sorted(
        {
            name
            for meta in provenance.values()
            for name, version in (meta.get("versions") or {}).items()
            if name in versions and version != versions[name]
        }
    )
    profile = jsons["profile_provenance"]
    harness = profile.get("harness")
    slurm = profile.get("slurm")
    return {
        "report": dict(report_meta),
        "versions": versions,
        "stages": stages,
        "config_hashes_agree": len(hashes) <= 1,
        "versions_differ": differing,
        "device": _device_name(profile.get("device")) if "profile" not in not_run else MISSING,
        "cpu_only": bool(profile.get("cpu_only")),
        "harness": harness.get("spec", MISSING) if isinstance(harness, Mapping) else harness,
        "slurm": (
            {str(k): v for k, v in slurm.items() if v is not None}
            if isinstance(slurm, Mapping)
            else None
        ),
    }


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
