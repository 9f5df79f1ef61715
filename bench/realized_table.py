"""bench/realized_vs_promised.py's table: each configuration's promised (replay) and realized
(Trainer) saving, the realized interval from the rounds, the stage's three-way verdict, and the
markdown it prints."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.realize import verdict as vd

TOLERANCE_PP = 5.0


def realized_interval(times: np.ndarray, base_times: np.ndarray) -> tuple[float, float]:
    """The realized saving's 95% interval from the rounds, each change's epoch paired with the
    baseline's of the same round (drift shared): the mean log time ratio ± t·se, as a saving
    (NaN with fewer than two rounds)."""
    from probes.replay.greg import t_quantile_975

    if len(times) < 2 or len(times) != len(base_times):
        return float("nan"), float("nan")
    logs = np.log(times / base_times)
    half = t_quantile_975(len(logs) - 1) * float(logs.std(ddof=1)) / np.sqrt(len(logs))
    return 1.0 - float(np.exp(logs.mean() + half)), 1.0 - float(np.exp(logs.mean() - half))


def paired_times(
    results: list[dict[str, float]], base: list[dict[str, float]]
) -> tuple[np.ndarray, np.ndarray]:
    """A configuration's epoch times and the baseline's of the same rounds (a result without a
    "round" is paired by position)."""
    base_by_round = {r.get("round", i): r["train_runtime"] for i, r in enumerate(base)}
    pairs = [
        (r["train_runtime"], base_by_round[r.get("round", i)])
        for i, r in enumerate(results)
        if r.get("round", i) in base_by_round
    ]
    times, base_times = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(times, dtype=float), np.asarray(base_times, dtype=float)


def too_wide_changes(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """The changes whose realized interval is wider than 2 × TOLERANCE_PP (or not known yet):
    too wide for the three-way rule to tell a miss of TOLERANCE_PP."""
    wide = []
    for name, results in runs.items():
        if name == pl.BASELINE:
            continue
        low, high = realized_interval(*paired_times(results, runs[pl.BASELINE]))
        if vd.too_wide(low, high, TOLERANCE_PP / 100):
            wide.append(name)
    return wide


def table_rows(
    document: dict[str, Any], estimates: pd.DataFrame, runs: dict[str, list[dict[str, float]]]
) -> list[dict[str, Any]]:
    """One row per realized configuration: promised (replay) and realized (Trainer) savings."""
    by_id = {c["id"]: c for c in document["changes"]}
    replay_s = dict(zip(estimates["strategy"], estimates["estimated_time_s"], strict=True))
    from probes.report.sections.replay import CHANGE_STRATEGY

    rows = []
    for name, results in runs.items():
        times, base_times = paired_times(results, runs[pl.BASELINE])
        per_round = 1.0 - times / base_times
        change = by_id.get(name, {})
        strategy = pl.BASELINE if name == pl.BASELINE else CHANGE_STRATEGY.get(name)
        promised = change.get("measured_saving") if name != pl.BASELINE else 0.0
        low = change.get("saving_ci_low") if name != pl.BASELINE else None
        high = change.get("saving_ci_high") if name != pl.BASELINE else None
        realized = 1.0 - times.mean() / base_times.mean()
        r_low, r_high = realized_interval(times, base_times)
        steps = results[0]["optimizer_steps"]
        replayed = replay_s.get(strategy) if strategy else None
        rows.append(
            {
                "change": name,
                "promised": promised,
                "ci_low": low,
                "ci_high": high,
                "realized": float(realized),
                "realized_sd": float(per_round.std(ddof=1)) if len(per_round) > 1 else 0.0,
                "within_5pp": None
                if promised is None or name == pl.BASELINE
                else bool(abs(realized - promised) * 100 <= TOLERANCE_PP),
                "inside_ci": None if low is None or high is None else bool(low <= realized <= high),
                "realized_low": r_low,
                "realized_high": r_high,
                # the stage's three-way rule (probes.realize.verdict), realized interval included
                "verdict": "baseline"
                if name == pl.BASELINE
                else vd.verdict(
                    realized,
                    promised if promised is not None else math.nan,
                    low if low is not None else math.nan,
                    high if high is not None else math.nan,
                    TOLERANCE_PP / 100,
                    r_low,
                    r_high,
                ),  # fmt: skip
                "rounds": int(len(times)),
                "trainer_epoch_s": float(times.mean()),
                "trainer_epoch_sd_s": float(times.std(ddof=1)) if len(times) > 1 else 0.0,
                "replay_epoch_s": None if replayed is None else float(replayed),
                "optimizer_steps": int(steps),
                "decision": change.get("decision", "baseline"),
            }
        )
    return rows


def _pct(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{100 * v:+.1f}%"


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "**no**")


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| change | promised saving [95% CI] | realized saving [95% CI over rounds] "
        "| verdict | within ±5 pp? | inside CI? | replayed epoch [s] | Trainer epoch [s] "
        "| (Trainer − replay) per step [s] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ci = (
            f" [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]"
            if r["ci_low"] is not None and r["ci_high"] is not None
            else ""
        )
        promised = (
            "0 (baseline)"
            if r["change"] == pl.BASELINE
            else ("not measured by the replay" if r["promised"] is None else _pct(r["promised"]))
        )
        extra = (
            "—"
            if r["replay_epoch_s"] is None
            else f"{(r['trainer_epoch_s'] - r['replay_epoch_s']) / r['optimizer_steps']:.4f}"
        )
        replayed = "—" if r["replay_epoch_s"] is None else f"{r['replay_epoch_s']:.2f}"
        lines.append(
            f"| {r['change']} | {promised}{ci} | {_pct(r['realized'])} "
            f"[{_pct(r['realized_low'])}, {_pct(r['realized_high'])}] | **{r['verdict']}** "
            f"| {_yes(r['within_5pp'])} | {_yes(r['inside_ci'])} "
            f"| {replayed} | {r['trainer_epoch_s']:.2f} ± {r['trainer_epoch_sd_s']:.2f} "
            f"| {extra} |"
        )
    return "\n".join([*lines, "", verdict_line(rows)]) + "\n"


def verdict_line(rows: list[dict[str, Any]]) -> str:
    """How many changes agree, disagree and are undecided, naming the undecided ones with their
    rounds: what more timing would decide (a --quick run's two rounds decide few)."""
    changes = [r for r in rows if r["change"] != pl.BASELINE]
    count = {v: sum(r["verdict"] == v for r in changes) for v in vd.VERDICTS}
    line = (
        f"Verdicts: {count[vd.AGREES]} agree, {count[vd.DISAGREES]} disagree, "
        f"{count[vd.UNDECIDED]} undecided of {len(changes)}."
    )
    undecided = [f"{r['change']} ({r['rounds']} rounds)" for r in changes
                 if r["verdict"] == vd.UNDECIDED]  # fmt: skip
    if undecided:
        line += (
            " Undecided: " + ", ".join(undecided) + ": one side's interval holds the other's "
            "saving but is too wide to tell a 5 pp miss (a realized interval: more rounds, "
            "--repeats / --extra-rounds; a promise: a longer replay, --budget-s)."
        )
    return line
