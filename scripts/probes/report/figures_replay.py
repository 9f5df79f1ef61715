"""The replay's two figures, for the report: estimated epoch time per strategy with its interval,
and the scaling fit against the points it was fitted on and the replayed micro-batches.

Each function draws from the stage's tables (results/profile/replay*.parquet) and writes a PNG.
Labels are strategy names and numbers only.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

DPI = 110
SIZE = (7.0, 4.2)


def _save(fig: plt.Figure, path: str | Path, dpi: int, left: float = 0.1) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.subplots_adjust(left=left, right=0.97, bottom=0.13, top=0.87)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)


def _cpu_suffix(frame: pd.DataFrame) -> str:
    if "cpu_only" in frame and bool(frame["cpu_only"].fillna(False).any()):
        return "\nCPU-only, lengths scaled: not comparable with a GPU"
    return ""


def epoch_time_by_strategy(replay: pd.DataFrame, path: str | Path, dpi: int = DPI) -> list[str]:
    """Horizontal bars: estimated epoch time per strategy with its 95% interval, best
    measured saving at the top; invalid strategies hatched and marked. Returns the bar labels."""
    frame = replay.copy()
    frame["_order"] = frame["saving_vs_random"].fillna(-np.inf)
    frame = frame.sort_values("_order", ascending=True)
    groups = frame["tie_group"].dropna().value_counts()
    labels = []
    for row in frame.itertuples():
        text = str(row.strategy)
        if not row.valid:
            text += " (invalid)"
        elif pd.notna(row.rank):
            tied = pd.notna(row.tie_group) and groups.get(row.tie_group, 0) > 1
            text = f"#{int(row.rank)}{' (tie)' if tied else ''} {text}"
        labels.append(text)
    y = np.arange(len(frame))
    value = frame["estimated_time_s"].to_numpy(dtype=float)
    low = value - frame["ci_low_s"].to_numpy(dtype=float)
    high = frame["ci_high_s"].to_numpy(dtype=float) - value
    # taller with more changes (batching and step-level ones), labels never cut off
    fig, ax = plt.subplots(figsize=(SIZE[0] + 1.0, max(SIZE[1], 0.3 * len(frame) + 1.3)))
    colors = ["#bbbbbb" if not v else "#4878d0" for v in frame["valid"]]
    bars = ax.barh(y, value, color=colors, xerr=[low, high], capsize=3, ecolor="black")
    for bar, valid in zip(bars, frame["valid"], strict=True):
        if not valid:
            bar.set_hatch("//")
    for yi, row in zip(y, frame.itertuples(), strict=True):
        if pd.notna(row.saving_vs_random):
            ax.text(
                row.ci_high_s,
                yi,
                f"  {100 * row.saving_vs_random:+.1f}% "
                f"[{100 * row.saving_ci_low:+.1f}, {100 * row.saving_ci_high:+.1f}]",
                va="center",
                fontsize=8,
            )
    ax.set_yticks(y, labels, fontsize=8)
    # two short lines: one long line ran past the figure's right edge once a long label (the
    # combined configuration's) pushed the axes right
    ax.set_xlabel(
        "estimated epoch time, s (95% interval, model-assisted)\nbeside each bar: saving vs random",
        fontsize=8,
    )
    ax.set_title("Measured epoch time per change" + _cpu_suffix(frame), fontsize=9)
    ax.set_xlim(0, float(np.nanmax(frame["ci_high_s"])) * 1.45)
    _save(fig, path, dpi, left=min(0.5, 0.05 + 0.0085 * max(len(label) for label in labels)))
    return labels


def fit_vs_measured(
    fit: pd.DataFrame, steps: pd.DataFrame, path: str | Path, dpi: int = DPI
) -> dict[str, int]:
    """The fit t(T) over its measured range, the fit points (every repeat), and the replayed
    padded micro-batches with the fit's row count (what the fit claims to predict). Returns how
    many points of each kind were drawn."""
    row = fit.iloc[0]
    fig, ax = plt.subplots(figsize=SIZE)
    points = steps[steps["kind"] == "fit_point"]
    ax.scatter(
        points["padded_length"],
        points["time_s"],
        s=14,
        color="#4878d0",
        label="fit points (every repeat)",
    )
    replayed = steps[
        (steps["kind"] == "micro_batch")
        & (steps["layout"] == "padded")
        & (steps["rows"] == row["rows"])
        & (steps["status"] == "OK")
    ]
    ax.scatter(
        replayed["padded_length"],
        replayed["time_s"],
        s=14,
        marker="x",
        color="#d65f5f",
        label=f"replayed micro-batches ({int(row['rows'])} rows, real lengths)",
    )
    if np.isfinite(row["a"]):
        grid = np.linspace(row["range_low"], row["range_high"], 200)
        ax.plot(
            grid,
            row["a"] * grid**2 + row["b"] * grid + row["c"],
            color="black",
            label=(
                f"fit a={row['a']:.3g} b={row['b']:.3g} c={row['c']:.3g} "
                f"(measured range {int(row['range_low'])}-{int(row['range_high'])})"
            ),
        )
    ax.set_xlabel("padded length T (tokens)")
    ax.set_ylabel("forward + backward, s")
    # the fit's batches carry the data's mean loss share in every row; real micro-batches carry
    # their own loss tokens (the head + CE over the vocabulary scale with them)
    ax.set_title("Scaling fit vs measured" + _cpu_suffix(fit), fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    _save(fig, path, dpi)
    return {"fit_points": int(len(points)), "replayed": int(len(replayed))}
