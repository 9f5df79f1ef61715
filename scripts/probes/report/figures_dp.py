"""The data-parallel figure: each strategy's straggler cost at W = 1, 2, 4, 8 ranks, from the bucket
stage's data_parallel.parquet (``probes.bucket.data_parallel``). Labels are strategy names and
numbers only."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from probes.bucket import data_parallel as dp  # noqa: E402
from probes.contracts import BATCH_REBALANCE, GLOBAL_SORT, LENGTH_GROUPED, RANDOM  # noqa: E402

STYLES = (
    (RANDOM, "o-", "random"),
    (LENGTH_GROUPED, "s-", "length_grouped (recommended bucket)"),
    (GLOBAL_SORT, "^--", "global_sort"),
    (BATCH_REBALANCE, "D-", "batch_rebalance (dp_size = W)"),
)


def dp_lines(table: pd.DataFrame, recommended_size: float | None) -> dict[str, pd.DataFrame]:
    """Per strategy drawn, its mean-over-seeds rows by world size (length_grouped: the
    recommended bucket size; packing: the first algorithm)."""
    summary = dp.summarise_data_parallel(table)
    lines: dict[str, pd.DataFrame] = {}
    for strategy, _, _ in STYLES:
        rows = summary.loc[summary["strategy"] == strategy]
        if strategy == LENGTH_GROUPED:
            if recommended_size is None:
                continue
            rows = rows.loc[rows["bucket_size_batches"] == int(recommended_size)]
        if not rows.empty:
            lines[strategy] = rows.sort_values("world_size")
    packing = sorted(s for s in summary["strategy"].unique() if str(s).startswith("packing_"))
    if packing:
        lines[packing[0]] = summary.loc[summary["strategy"] == packing[0]].sort_values("world_size")
    return lines


def straggler_by_world_size(
    table: pd.DataFrame,
    recommended_size: float | None,
    gain_metric: str,
    configured: int,
    path: str | Path,
    dpi: int = 110,
) -> None:
    """Left: straggler overhead (slowest rank / mean − 1); right: the slowest rank's cost saved
    against random at the same W. x: world size (log 2); the configured W is marked."""
    lines = dp_lines(table, recommended_size)
    what = "padded tokens" if gain_metric == "tokens" else "dense attention cost"
    straggler, gain = dp.straggler_column(gain_metric), dp.gain_column(gain_metric)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 4.0))
    styles = {s: (style, name) for s, style, name in STYLES}
    for i, (strategy, rows) in enumerate(lines.items()):
        style, name = styles.get(strategy, ("x:", f"{strategy} (bins of max_seq_len)"))
        if strategy == LENGTH_GROUPED and recommended_size is not None:
            name = f"length_grouped (recommended bucket, {int(recommended_size)} micro-batches)"
        x = rows["world_size"].to_numpy(dtype="float64")
        size = 7 if style.startswith("x") else 4
        left.plot(x, 100 * rows[straggler], style, color=f"C{i}", markersize=size, label=name)
        right.plot(x, 100 * rows[gain], style, color=f"C{i}", markersize=size)
    worlds = sorted({int(w) for rows in lines.values() for w in rows["world_size"]})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.minorticks_off()
        ax.set_xlabel("data-parallel ranks W")
        ax.grid(alpha=0.3)
        if configured > 1:
            ax.axvline(configured, color="0.5", linewidth=0.8, linestyle="--")
    left.set_ylabel(f"straggler overhead, % of balanced ({what})", fontsize=8)
    left.set_title("Σ steps (slowest rank) / Σ steps (mean rank) − 1", fontsize=9)
    right.set_ylabel(f"slowest-rank {what} saved vs random, %", fontsize=8)
    right.set_title("saving against random at the same W", fontsize=9)
    left.legend(fontsize=7, frameon=False, loc="upper left")
    fig.suptitle(
        f"Data-parallel straggler cost per strategy (mean over seeds; configured W = {configured})",
        fontsize=10,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.13, top=0.86, wspace=0.28)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)
