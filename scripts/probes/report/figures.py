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

from probes.contracts import PACKING, TRAINING_STATUSES  # noqa: E402
from probes.report import figures_replay  # noqa: E402
from probes.report.findings import fit_problem  # noqa: E402
from probes.report.format import label  # noqa: E402
from probes.report.load import diversity_level_name  # noqa: E402
from probes.report.sections.kernels import device_rows  # noqa: E402
from probes.report.sections.padding import OTHER_SOURCES  # noqa: E402

DPI = 110
SIZE = (7.0, 4.2)


def _save(
    fig: plt.Figure, path: str | Path, dpi: int, left: float = 0.1, right: float = 0.97
) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # fixed margins: tight_layout costs half of the figures' time and the 5 s render budget
    fig.subplots_adjust(left=left, right=right, bottom=0.12, top=0.92)
    # no embedded date, so the same inputs give the same bytes
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


def length_histogram(
    distribution: pd.DataFrame, n_sources: int, path: str | Path, top_n: int = 8, dpi: int = DPI
) -> list[str]:
    """Tokens per example per source, from the padding stage's own histogram bins (log axes).

    The `top_n` largest sources are drawn one by one; the rest (and the stage's pooled "(other)")
    are summed into one "other (k sources)" line, so the plot stays readable with many sources.
    Returns the legend labels.
    """
    rows = distribution[
        (distribution["measure"] == "n_tokens") & (distribution["scope"] == "source")
    ]
    bins = rows[rows["kind"] == "bin"].sort_values("bin_lo")
    counts = rows[(rows["kind"] == "stat") & (rows["statistic"] == "count")]
    counts = counts.set_index("source")["value"]
    named = [s for s in counts.sort_values(ascending=False).index if s != OTHER_SOURCES]
    keep = named[:top_n]
    fig, ax = plt.subplots(figsize=SIZE)
    if bins.empty:
        ax.text(0.5, 0.5, "no examples with tokens", ha="center", va="center")
        _save(fig, path, dpi)
        return []
    edges = np.r_[bins.drop_duplicates("bin_lo")["bin_lo"].to_numpy(), bins["bin_hi"].max()]
    lines = [(label(name, 30), bins[bins["source"] == name], {}) for name in keep]
    rest = bins[~bins["source"].isin(keep)]
    if not rest.empty:  # grey and dashed: a pool, not a source
        style = {"color": "0.5", "linestyle": "--"}
        lines.append((f"other ({max(n_sources - len(keep), 1)} sources)", rest, style))
    for name, group, style in lines:
        values = group.groupby("bin_lo")["value"].sum().reindex(edges[:-1], fill_value=0.0)
        ax.stairs(values.to_numpy(), edges, linewidth=1.4, label=name, **style)
    ax.set_xscale("log")
    ax.set_yscale("log", nonpositive="mask")
    filled = bins.loc[bins["value"] > 0]
    if not filled.empty:  # the stage's bins start at 1 token: show only the populated range
        ax.set_xlim(filled["bin_lo"].min() / 1.2, filled["bin_hi"].max() * 1.2)
    ax.set_xlabel("tokens per example (log)")
    ax.set_ylabel("examples (log)")
    ax.set_title("Tokenized length per source (OK and TRUNCATED examples)")
    # outside the axes: inside, it covered the pooled line and the tallest bins
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path, dpi, right=0.74)
    return [name for name, _, _ in lines]


def scaling_curve(
    scaling: pd.DataFrame,
    fit: dict | None,
    path: str | Path,
    dpi: int = DPI,
    problem: str | None = None,
):
    """Measured step time per length, OOM points marked, and the fitted a·T² + b·T + c;
    `problem` (why the fit cannot price anything) goes under the title."""
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
    if problem:
        ax.text(
            0.5, 0.97, problem, transform=ax.transAxes, ha="center", va="top", fontsize=7, wrap=True
        )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, frameon=False)
    _save(fig, path, dpi)


def spaced_ticks(
    values: np.ndarray, keep: float | None = None, min_decades: float = 0.15
) -> list[float]:
    """The values to label on a log axis, dropping any closer than `min_decades` to a labelled
    neighbour (400 and 512 would print as "400512"); `keep` (the recommendation) always stays."""
    values = sorted({float(v) for v in values if v > 0})
    must = float(keep) if keep is not None and float(keep) in values else None
    chosen: list[float] = []
    for value in values:
        near_must = must is not None and value != must and abs(np.log10(value / must)) < min_decades
        if near_must:
            continue
        if value == must:
            chosen = [c for c in chosen if abs(np.log10(value / c)) >= min_decades]
            chosen.append(value)
        elif not chosen or np.log10(value / chosen[-1]) >= min_decades:
            chosen.append(value)
    if values and values[-1] not in chosen:  # the global sort: replace the last label
        if chosen and np.log10(values[-1] / chosen[-1]) < min_decades and chosen[-1] != must:
            chosen.pop()
        chosen.append(values[-1])
    return chosen


def bucket_tradeoff(
    summary: pd.DataFrame,
    recommended_size: float | None,
    level: str,
    path: str | Path,
    dpi: int = DPI,
):
    """Efficiency (top) and source diversity relative to random (bottom) against bucket size,
    on a log x axis, from the bucket stage's summary.parquet (probes.bucket.sweep.summarise).

    Both panels share the bucket size, so each label sits on its own x whatever the diversity
    does (on real data it often moves by under 1%, and a packing point far off it used to set
    the range and squeeze every bucket size into one corner). Packing has no bucket size: its
    token efficiency is a labelled horizontal line, its diversity a note in the bottom panel.
    """
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(SIZE[0], SIZE[1] * 1.25), sharex=True, height_ratios=(2.2, 1)
    )
    sweep = summary[summary["bucket_size_batches"].notna()].copy()
    sweep["bucket_size_batches"] = sweep["bucket_size_batches"].astype("float64")
    sweep = sweep.sort_values("bucket_size_batches")
    sizes = sweep["bucket_size_batches"].to_numpy(dtype="float64")
    for column, style, name in (
        ("token_efficiency", "o-", "token efficiency"),
        ("attention_efficiency", "s--", "attention efficiency"),
    ):
        top.plot(sizes, sweep[column], style, markersize=4, label=name)
    packing = summary[summary["strategy"].str.startswith(PACKING)]
    packing_notes = []
    for i, (_, row) in enumerate(packing.iterrows()):
        top.axhline(
            row["token_efficiency"], color=f"C{3 + i}", linestyle=":", linewidth=1.2,
            label=f"{row['strategy']} token efficiency (no bucket size)",
        )  # fmt: skip
        packing_notes.append(f"{row['strategy']} {row['diversity_rel_random']:.3f}×")
    if recommended_size is not None:
        chosen = sweep[sweep["bucket_size_batches"] == float(recommended_size)]
        for ax, column in ((top, "token_efficiency"), (bottom, "diversity_rel_random")):
            ax.plot(
                chosen["bucket_size_batches"], chosen[column], "o", markersize=13,
                markerfacecolor="none", color="k",
                label=f"recommended ({float(recommended_size):g} micro-batches/bucket)"
                if ax is top else None,
            )  # fmt: skip
    top.set_ylim(0, 1.05)
    top.set_ylabel("efficiency (real / padded)")
    top.set_title("Bucket-size sweep: efficiency and source diversity")
    top.legend(fontsize=7, frameon=False, loc="lower right")
    bottom.plot(sizes, sweep["diversity_rel_random"], "o-", color="C2", markersize=4)
    bottom.axhline(1.0, color="0.6", linewidth=0.8)
    low = float(np.nanmin(sweep["diversity_rel_random"])) if len(sweep) else 1.0
    high = float(np.nanmax(sweep["diversity_rel_random"])) if len(sweep) else 1.0
    pad = max((high - low) * 0.25, 0.005)
    bottom.set_ylim(min(low, 1.0) - pad, max(high, 1.0) + pad)
    bottom.set_ylabel(f"diversity per\n{level}, × random", fontsize=8)
    if packing_notes:
        bottom.text(
            0.99, 0.05, "packing: " + ", ".join(packing_notes), transform=bottom.transAxes,
            ha="right", va="bottom", fontsize=7, color="0.3",
        )  # fmt: skip
    bottom.set_xscale("log")
    ticks = spaced_ticks(sizes, recommended_size)
    bottom.set_xticks(ticks, [f"{v:g}" for v in ticks], fontsize=7)
    bottom.minorticks_off()
    bottom.set_xlabel("bucket size (micro-batches per bucket, log; 1 = random, largest = sort)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.11, top=0.94, hspace=0.08)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


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
    _save(fig, path, dpi, left=0.24)


FIGURES = (
    "lengths",
    "scaling",
    "bucket",
    "data_parallel",
    "kernels",
    "replay_epoch",
    "replay_fit",
    "memory",
)


def draw_all(
    inputs: dict, directory: str | Path, top_n: int = 8, dpi: int = DPI
) -> dict[str, str | None]:
    """Draw every figure whose stage ran into `directory`; {name: file name or None (not run)}."""
    tables, jsons, not_run = inputs["tables"], inputs["json"], inputs["not_run"]
    directory = Path(directory)
    drawn: dict[str, str | None] = dict.fromkeys(FIGURES)
    if "padding" not in not_run:
        lengths = tables["padding_lengths"]
        n_sources = lengths.loc[lengths["status"].isin(TRAINING_STATUSES), "source"].nunique()
        length_histogram(
            tables["padding_distribution"], n_sources, directory / "lengths.png", top_n, dpi
        )
        drawn["lengths"] = "lengths.png"
    if "profile" not in not_run and not tables["profile_scaling"].empty:
        fit = tables["profile_fit"]
        usable = not fit.empty and (fit.iloc[0]["n_points"] or 0) >= 3
        fit_row = fit.iloc[0].to_dict() if usable else None
        problem = fit_problem(tables, not_run)
        scaling_curve(tables["profile_scaling"], fit_row, directory / "scaling.png", dpi, problem)
        drawn["scaling"] = "scaling.png"
    if "bucket" not in not_run and not tables["bucket_summary"].empty:
        rec = jsons["bucket_recommendation"]
        size = (rec.get("recommended") or {}).get("bucket_size_batches")
        level = diversity_level_name(rec)
        bucket_tradeoff(tables["bucket_summary"], size, level, directory / "bucket.png", dpi)
        drawn["bucket"] = "bucket.png"
        if not tables["bucket_data_parallel"].empty:
            from probes.report import figures_dp

            world = int((rec.get("data_parallel") or {}).get("world_size", 1))
            metric = str((rec.get("thresholds") or {}).get("gain_metric", "tokens"))
            figures_dp.straggler_by_world_size(
                tables["bucket_data_parallel"], size, metric, world, directory / "dp.png", dpi
            )
            drawn["data_parallel"] = "dp.png"
    if "profile" not in not_run and not tables["profile_kernels"].empty:
        cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
        kernels = device_rows(tables["profile_kernels"], cpu_only)
        kernel_shares(kernels, directory / "kernels.png", cpu_only, dpi)
        drawn["kernels"] = "kernels.png"
    if "replay" not in not_run and not tables["replay_estimates"].empty:
        figures_replay.epoch_time_by_strategy(
            tables["replay_estimates"], directory / "replay_epoch.png", dpi
        )
        drawn["replay_epoch"] = "replay_epoch.png"
        if not tables["replay_fit"].empty and not tables["replay_steps"].empty:
            figures_replay.fit_vs_measured(
                tables["replay_fit"], tables["replay_steps"], directory / "replay_fit.png", dpi
            )
            drawn["replay_fit"] = "replay_fit.png"
    if "memory" not in not_run and tables.get("memory_shapes") is not None:
        from probes.report.sections.memory import memory_figure

        if memory_figure(tables["memory_shapes"], directory / "memory.png", dpi) is not None:
            drawn["memory"] = "memory.png"
    return drawn
