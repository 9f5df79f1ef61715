"""The "Padding" section: length distribution, waste per strategy, CE chunk sizes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import STATUSES, TRAINING_STATUSES
from probes.report.format import reason_code
from probes.report.load import ReportInputError
from probes.report.sections.shared import not_run_section

OTHER_SOURCES = "(other)"  # the padding stage pools sources beyond its limit under this label


DISTRIBUTION_STATS = ("count", "tokens", "p50", "p90", "p99", "max")


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
        return not_run_section(not_run["padding"])
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


def waste_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Waste rows of summary.parquet pivoted to one row per strategy: value and std per metric."""
    waste = summary[summary["section"] == "waste"]
    wide = waste.pivot_table(
        index="strategy", columns="metric", values=["value", "std"], aggfunc="first", sort=False
    )
    # token_waste_value, token_waste_std, attention_waste_value, attention_waste_std
    wide.columns = [f"{metric}_{stat}" for stat, metric in wide.columns]
    return wide.reset_index()
