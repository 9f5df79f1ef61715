"""The report's figures: PNGs drawn from the stage tables with matplotlib's Agg backend.

Each function draws one figure from a table and writes it to `path`. Labels are source names,
column names and numbers only; no text from the data.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on a cluster node, and the fastest backend to import

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from probes.report import OK_STATUSES, label  # noqa: E402

DPI = 110
SIZE = (7.0, 4.2)


def _save(fig: plt.Figure, path: str | Path, dpi: int) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # no embedded date, so the same inputs give the same bytes
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


def top_sources(sources: pd.Series, top_n: int) -> pd.Series:
    """Source labels with all but the `top_n` most frequent merged into "other (k sources)"."""
    counts = sources.value_counts()
    if len(counts) <= top_n:
        return sources.astype(str)
    keep = set(counts.index[:top_n])
    other = f"other ({len(counts) - top_n} sources)"
    return sources.where(sources.isin(keep), other).astype(str)


def length_histogram(lengths: pd.DataFrame, path: str | Path, top_n: int = 8, dpi: int = DPI):
    """Tokenized length per source (examples that train), log-spaced bins, log axes."""
    trains = lengths[lengths["status"].isin(OK_STATUSES) & (lengths["n_tokens"] > 0)]
    fig, ax = plt.subplots(figsize=SIZE)
    if trains.empty:
        ax.text(0.5, 0.5, "no examples with tokens", ha="center", va="center")
        _save(fig, path, dpi)
        return
    tokens = trains["n_tokens"].to_numpy(dtype="float64")
    low, high = max(1.0, tokens.min()), max(tokens.max(), 2.0)
    bins = np.geomspace(low, high * 1.0001, 40)
    grouped = top_sources(trains["source"], top_n)
    order = grouped.value_counts().index
    for name in order:
        values = tokens[(grouped == name).to_numpy()]
        ax.hist(values, bins=bins, histtype="step", linewidth=1.4, label=f"{label(name, 30)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per example (log)")
    ax.set_ylabel("examples (log)")
    ax.set_title("Tokenized length per source")
    ax.legend(fontsize=7, loc="upper right", frameon=False)
    _save(fig, path, dpi)


def scaling_curve(scaling: pd.DataFrame, fit: dict | None, path: str | Path, dpi: int = DPI):
    """Measured step time per length, OOM points marked, and the fitted a·T² + b·T + c."""
    fig, ax = plt.subplots(figsize=SIZE)
    ok = scaling[scaling["status"] == "OK"]
    oom = scaling[scaling["status"] == "OOM"]
    ax.plot(ok["seq_len"], ok["time_s"], "o", color="C0", label="measured")
    top = float(scaling["seq_len"].max()) if not scaling.empty else 1.0
    if fit is not None:
        t = np.linspace(0, top * 1.05, 200)
        a, b, c = (float(fit[k]) for k in ("a", "b", "c"))
        ax.plot(t, a * t**2 + b * t + c, "-", color="C1", label="fit a·T² + b·T + c")
        ax.plot(t, a * t**2, "--", color="C2", linewidth=1, label="quadratic term a·T²")
    if not oom.empty:  # drawn where the fit says the step would have taken, else at the top
        if fit is not None:
            t_oom = oom["seq_len"].to_numpy(dtype="float64")
            y = a * t_oom**2 + b * t_oom + c
        else:
            y = [float(ok["time_s"].max()) if not ok.empty else 1.0] * len(oom)
        ax.plot(oom["seq_len"], y, "x", color="C3", markersize=9, label="out of memory")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("step time per micro-batch (s)")
    ax.set_title("Step time vs sequence length")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, frameon=False)
    _save(fig, path, dpi)


def bucket_tradeoff(
    means: pd.DataFrame, recommended_size: float | None, path: str | Path, dpi: int = DPI
):
    """Efficiency against source diversity (relative to random) over the bucket-size sweep."""
    fig, ax = plt.subplots(figsize=SIZE)
    grouped = means[means["strategy"] == "length_grouped"].sort_values("bucket_size")
    for column, style, name in (
        ("token_efficiency", "o-", "token efficiency"),
        ("attention_efficiency", "s--", "attention efficiency"),
    ):
        ax.plot(grouped["entropy_rel"], grouped[column], style, markersize=4, label=name)
    for _, row in grouped.iterrows():
        ax.annotate(
            f"{row['bucket_size']:g}",
            (row["entropy_rel"], row["token_efficiency"]),
            textcoords="offset points",
            xytext=(3, 4),
            fontsize=7,
        )
    for strategy, marker in (("random", "D"), ("packing", "*")):
        rows = means[means["strategy"] == strategy]
        if not rows.empty:
            ax.plot(
                rows["entropy_rel"],
                rows["token_efficiency"],
                marker,
                markersize=10,
                linestyle="none",
                label=f"{strategy} (token)",
            )
    if recommended_size is not None:
        chosen = grouped[grouped["bucket_size"] == recommended_size]
        ax.plot(
            chosen["entropy_rel"],
            chosen["token_efficiency"],
            "o",
            markersize=14,
            markerfacecolor="none",
            color="k",
            label=f"recommended ({recommended_size:g} micro-batches/bucket)",
        )
    ax.set_xlabel("source diversity per batch (entropy, relative to random)")
    ax.set_ylabel("efficiency (real / padded)")
    ax.set_title("Bucket-size sweep: efficiency vs diversity (labels: bucket size)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, frameon=False, loc="lower left")
    _save(fig, path, dpi)


def kernel_shares(kernels: pd.DataFrame, path: str | Path, cpu_only: bool, dpi: int = DPI):
    """Share of summed device kernel time per category (device rows only)."""
    rows = kernels.sort_values("share")
    fig, ax = plt.subplots(figsize=SIZE)
    ax.barh(rows["category"].astype(str), rows["share"] * 100, color="C0")
    for y, share in enumerate(rows["share"]):
        ax.text(share * 100, y, f" {share * 100:.1f}%", va="center", fontsize=8)
    what = "CPU self time of leaf ops (CPU-only run)" if cpu_only else "CUDA kernel time"
    ax.set_xlabel(f"share of {what} (%)")
    ax.set_title("Where the step's time went, by kernel category")
    top = float(rows["share"].max()) * 100 if not rows.empty else 100.0
    ax.set_xlim(0, min(100.0, top * 1.25) if top > 0 else 100.0)
    _save(fig, path, dpi)


FIGURES = ("lengths", "scaling", "bucket", "kernels")


def draw_all(
    inputs: dict, directory: str | Path, top_n: int = 8, dpi: int = DPI
) -> dict[str, str | None]:
    """Draw every figure whose stage ran into `directory`; {name: file name or None (not run)}."""
    from probes.report import device_rows, sweep_means

    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    directory = Path(directory)
    drawn: dict[str, str | None] = dict.fromkeys(FIGURES)
    if "padding" not in not_run:
        length_histogram(tables["padding_lengths"], directory / "lengths.png", top_n, dpi)
        drawn["lengths"] = "lengths.png"
    if "profile" not in not_run and not tables["profile_scaling"].empty:
        fit = tables["profile_fit"]
        fit_row = fit.iloc[0].to_dict() if not fit.empty and fit.iloc[0]["n_points"] >= 3 else None
        scaling_curve(tables["profile_scaling"], fit_row, directory / "scaling.png", dpi)
        drawn["scaling"] = "scaling.png"
    if "bucket" not in not_run and not tables["bucket_sweep"].empty:
        size = jsons["bucket_recommendation"].get("bucket_size")
        means = sweep_means(tables["bucket_sweep"])
        bucket_tradeoff(means, size, directory / "bucket.png", dpi)
        drawn["bucket"] = "bucket.png"
    if "profile" not in not_run and not tables["profile_kernels"].empty:
        cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
        kernels = device_rows(tables["profile_kernels"], cpu_only)
        kernel_shares(kernels, directory / "kernels.png", cpu_only, dpi)
        drawn["kernels"] = "kernels.png"
    return drawn
