"""The report's measured savings: the replay's per-strategy table as the Summary's ranked changes.

``results/profile/replay.parquet`` (``probes.replay.stage``) holds, per batching strategy, the
epoch time measured on a stratified sample of its real micro-batches, the saving against random
batches with a 95% interval (model-assisted, probes.replay.estimate), the stage's rank and tie
group (overlapping intervals), the scaling fit's prediction beside it and whether they agree.
This module turns those rows into the changes the Summary lists; it derives nothing the stage did
not measure except the inversion of ``pad_to_max_seq_len`` (a saving *against* padding to
max_seq_len, exact for the interval's ends because 1 − 1/(1 − s) is monotonic).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import (
    BATCH_REBALANCE,
    GLOBAL_SORT,
    GROUP_BY_LENGTH_BUILTIN,
    LENGTH_GROUPED,
    PACKING,
    PAD_TO_MAX_SEQ_LEN,
    RANDOM,
    RANDOM_NO_IDLE,
    TRAINING_STATUSES,
)
from probes.report.format import finite, fmt_count, fmt_pct

# recommendations.json change id (probes.apply.document) -> the replayed strategy that measured it
CHANGE_STRATEGY = {
    "length_grouped": LENGTH_GROUPED,
    GROUP_BY_LENGTH_BUILTIN: GROUP_BY_LENGTH_BUILTIN,
    BATCH_REBALANCE: BATCH_REBALANCE,
    PACKING: PACKING,
    "drop_no_loss_examples": RANDOM_NO_IDLE,
}
C_MEANING = (
    "c is the fixed cost of one eager step at these shapes: on a GPU mostly host launch "
    "overhead (Python and kernel launches the card waits on), not a per-micro-batch cost that "
    "packing or fewer micro-batches removes one-for-one; the replay measures each strategy's "
    "real micro-batches instead of assuming it"
)


def replay_problem(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> str | None:
    """Why there are no measured savings, or None when the replay's table can be read."""
    if "replay" in not_run:
        return f"the replay did not run ({not_run['replay']})"
    estimates = tables["replay_estimates"]
    if estimates.empty or RANDOM not in set(estimates["strategy"]):
        return "the replay measured no random baseline"
    return None


def invert_saving(value: Any) -> float | None:
    """A saving s = 1 − T/T_random read the other way: 1 − T_random/T (None if undefined)."""
    s = finite(value)
    if s is None or s >= 1:
        return None
    return 1.0 - 1.0 / (1.0 - s)


def idle_examples(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> int | None:
    """Examples that train without a loss token (padding lengths), None without the padding."""
    if "padding" in not_run:
        return None
    lengths = tables["padding_lengths"]
    trains = lengths[lengths["status"].isin(TRAINING_STATUSES)]
    return int((trains["n_loss_tokens"] == 0).sum())


def change_title(strategy: str, bucket_size: Any, max_seq_len: Any, idle: int | None) -> str:
    """What a user changes to get a strategy, in the words of the Summary."""
    if strategy == LENGTH_GROUPED:
        size = finite(bucket_size)
        return "Group batches by length" + (
            f": buckets of {size:g} micro-batches" if size is not None else ""
        )
    if strategy == GROUP_BY_LENGTH_BUILTIN:
        return "transformers' built-in group_by_length"
    if strategy == BATCH_REBALANCE:
        return "transformers' batch_rebalance sampler (variable micro-batch size)"
    if strategy == GLOBAL_SORT:
        return "Sort the whole dataset by length (one bucket)"
    if strategy == PACKING:
        size = finite(max_seq_len)
        return "Pack whole examples into " + (
            f"{fmt_count(size)}-token rows" if size is not None else "max_seq_len rows"
        )
    if strategy == RANDOM_NO_IDLE:
        count = fmt_count(idle) if idle is not None else "the"
        return f"Drop the {count} examples that carry no loss token"
    if strategy == PAD_TO_MAX_SEQ_LEN:
        return "Pad each batch to its longest member, not to max_seq_len"
    if strategy == RANDOM:
        return "Random batches (the baseline)"
    from probes.step import combined
    from probes.step.changes import title_of

    if combined.is_combined(strategy):
        return combined.title_of(
            strategy, lambda part: change_title(part, bucket_size, max_seq_len, idle)
        )
    return title_of(strategy) or strategy


def verdict(low: float | None, high: float | None) -> str:
    """What the interval says: faster, slower, or not distinguishable from the baseline."""
    if low is None or high is None:
        return "not measured"
    if low > 0:
        return "faster"
    if high < 0:
        return "slower: not recommended"
    return "not distinguishable from the baseline: its interval includes 0"


def _steps_text(row: Mapping[str, Any], base: Mapping[str, Any]) -> str | None:
    """Said next to the saving when a strategy changes the number of optimizer steps."""
    steps, base_steps = finite(row["optimizer_steps"]), finite(base["optimizer_steps"])
    if steps is None or base_steps is None or steps == base_steps:
        return None
    tokens = finite(row["tokens_per_optimizer_step"])
    base_tokens = finite(base["tokens_per_optimizer_step"])
    ratio = f" ({tokens / base_tokens:.1f}× tokens per update)" if tokens and base_tokens else ""
    return (
        f"optimizer steps {fmt_count(base_steps)} → {fmt_count(steps)}{ratio}: a hyperparameter "
        f"change, not only a speed-up; grad_accum {fmt_count(row['grad_accum_for_same_tokens'])} "
        f"instead of {fmt_count(row['grad_accum'])} keeps tokens per update comparable"
    )


def _fit_text(row: Mapping[str, Any], inverted: bool) -> tuple[str, bool]:
    """The fit's predicted saving beside the measured one, and whether they disagree."""
    predicted = finite(row["fit_predicted_saving"])
    if predicted is None:
        reason = str(row.get("fit_reason") or "no usable fit")
        return f"cannot price: {reason}", False
    if inverted:
        predicted = invert_saving(predicted)
    agrees = row.get("fit_agrees")
    if agrees is not None and not bool(agrees):
        return f"{fmt_pct(predicted)}: **disagrees** with the measurement beyond its interval", True
    return f"{fmt_pct(predicted)} (within the measured interval)", False


def _missing(value: Any) -> bool:
    """A scalar NaN/NA/None (lists and arrays are values, never missing)."""
    return value is None or (pd.api.types.is_scalar(value) and bool(pd.isna(value)))


def _row_dict(row: pd.Series) -> dict[str, Any]:
    return {k: None if _missing(v) else v for k, v in row.items()}


def measured_changes(
    tables: Mapping[str, pd.DataFrame],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
) -> dict[str, Any]:
    """The Summary's ranked changes from replay.parquet.

    Rows follow the stage's rank (tie groups of overlapping intervals), then the measured saving;
    random is the baseline row; ``pad_to_max_seq_len`` is read the other way (the saving of
    padding to the longest member for someone who pads to max_seq_len) and listed last; an
    invalid strategy is never a row, it is listed under ``not_recommended`` with its reason."""
    frame = ranked_estimates(tables["replay_estimates"])
    recommended = (jsons["bucket_recommendation"].get("recommended") or {}) if jsons else {}
    idle = idle_examples(tables, not_run)
    base = _row_dict(frame[frame["strategy"] == RANDOM].iloc[0])
    max_seq_len = finite(base.get("max_seq_len"))
    rows, conditional, not_recommended, disagreements, unpriced = [], [], [], [], []
    for _, series in frame.iterrows():
        row = _row_dict(series)
        strategy = str(row["strategy"])
        title = change_title(
            strategy,
            recommended.get("bucket_size_batches"),
            max_seq_len or row.get("max_seq_len"),
            idle,
        )
        if not bool(row["valid"]):
            not_recommended.append(
                {"strategy": strategy, "title": title, "reason": row.get("invalid_reason")}
            )
            continue
        if strategy == RANDOM_NO_IDLE and idle == 0:
            continue  # nothing to drop: the same micro-batches as random
        entry = summary_row(row, base, title)
        if entry["fit_disagrees"]:
            disagreements.append(title)
        if not entry["fit_priced"] and strategy != RANDOM:
            unpriced.append({"title": title, "reason": row.get("fit_reason") or "no usable fit"})
        (conditional if strategy == PAD_TO_MAX_SEQ_LEN else rows).append(entry)
    ties = rank_shown_rows(rows)
    recommended_rows = [r for r in rows if r["verdict"] == "faster"]
    cpu_only = bool(frame["cpu_only"].fillna(False).astype(bool).any())
    return {
        "rows": rows + conditional,
        "ties": ties,
        "not_recommended": not_recommended,
        "disagreements": disagreements,
        "unpriced": unpriced,
        "best": recommended_rows[0]["title"] if recommended_rows else None,
        "best_tied": bool(recommended_rows and recommended_rows[0]["tied"]),
        "cpu_only": cpu_only,
        "max_seq_len": max_seq_len,
        "host_bound": None if cpu_only else host_bound_note(frame, host_bound_threshold(jsons)),
        "out_of_range": [
            {"title": r["title"], "share": r["out_of_range"]}
            for r in rows + conditional
            if r.get("out_of_range")
        ],
        **replay_measurement_notes((jsons or {}).get("replay_control")),
        "more_budget": more_budget_key((jsons or {}).get("replay_control"), cpu_only),
        "power": power_view((jsons or {}).get("replay_control")),
        "busy": busy_view((jsons or {}).get("replay_control")),
    }


def ranked_estimates(estimates: pd.DataFrame) -> pd.DataFrame:
    """The replay's table in the stage's rank order, then by measured saving (NaN last)."""
    frame = estimates.copy()
    frame["_rank"] = pd.to_numeric(frame["rank"], errors="coerce")
    frame["_saving"] = pd.to_numeric(frame["saving_vs_random"], errors="coerce")
    return frame.sort_values(["_rank", "_saving"], ascending=[True, False], na_position="last")


def summary_row(row: Mapping[str, Any], base: Mapping[str, Any], title: str) -> dict[str, Any]:
    """One valid strategy of the replay as a Summary row (`base` is random's row);
    ``pad_to_max_seq_len`` is read the other way, against padding to max_seq_len, unranked."""
    strategy = str(row["strategy"])
    inverted = strategy == PAD_TO_MAX_SEQ_LEN
    saving, low, high = (
        finite(row[k]) for k in ("saving_vs_random", "saving_ci_low", "saving_ci_high")
    )
    if inverted:
        saving, low, high = invert_saving(saving), invert_saving(high), invert_saving(low)
    fit_text, disagrees = _fit_text(row, inverted)
    entry = {
        "strategy": strategy,
        "title": title,
        "rank": None if inverted else finite(row["rank"]),
        "tie_group": None if inverted else row.get("tie_group"),
        "tied": False,
        "baseline": strategy == RANDOM,
        "saving": saving,
        "saving_low": low,
        "saving_high": high,
        "versus": "padding to max_seq_len" if inverted else "random batches",
        "verdict": "baseline" if strategy == RANDOM else verdict(low, high),
        "estimated_time_s": finite(row["estimated_time_s"]),
        "ci_low_s": finite(row["ci_low_s"]),
        "ci_high_s": finite(row["ci_high_s"]),
        "fit": fit_text,
        "fit_disagrees": disagrees,
        "fit_priced": finite(row["fit_predicted_saving"]) is not None,
        "steps": None if inverted else _steps_text(row, base),
        "host_bound_share": finite(row.get("host_bound_share")),
        "gpu_busy_share": finite(row.get("gpu_busy_share")),
        "sampled": finite(row["sampled"]),
        "micro_batches": finite(row["micro_batches"]),
    }
    outside = finite(row.get("model_out_of_range_share"))
    entry["out_of_range"] = outside if outside else None
    return entry


def rank_shown_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Rank the rows shown in place (a hidden strategy leaves no gap; a tie shares its rank)
    and mark the tied ones; returns the titles of each tie group of more than one row."""
    first_position: dict[Any, int] = {}
    for position, entry in enumerate(rows, 1):
        key = entry["tie_group"] if entry["tie_group"] is not None else ("alone", position)
        entry["rank"] = first_position.setdefault(key, position)
    ties = []
    for group in dict.fromkeys(r["tie_group"] for r in rows if r["tie_group"] is not None):
        members = [r for r in rows if r["tie_group"] == group]
        if len(members) > 1:
            for member in members:
                member["tied"] = True
            ties.append([m["title"] for m in members])
    return ties


def more_budget_key(control: Any, cpu_only: bool) -> str | None:
    """The config key that buys narrower intervals when the timing stopped on its budget (None
    when it stopped on a decision or ran out of micro-batches)."""
    stopping = control.get("stopping") if isinstance(control, Mapping) else None
    if not isinstance(stopping, Mapping) or stopping.get("stopped_by") != "budget":
        return None
    return "replay.cpu.budget_s" if cpu_only else "replay.budget_s"


# The instrument's CV (identical micro-batches back to back) on an idle machine: 1.2-3.2% on
# the default CPU run; with another test run beside it 12%, under a load of 4-5 on 2 cores 83%
BUSY_CV = 0.10


def busy_view(control: Any) -> dict[str, Any] | None:
    """The first screen's warning when the machine was busy while the replay timed: its
    instrument's CV over BUSY_CV, with the load average and cores it ran on; None otherwise."""
    instrument = control.get("instrument") if isinstance(control, Mapping) else None
    cv = finite(instrument.get("cv")) if isinstance(instrument, Mapping) else None
    if cv is None or cv <= BUSY_CV:
        return None
    load = instrument.get("load_average") or [None]
    done = instrument.get("done") or {}
    return {"cv": cv, "load": finite(load[0]), "cores": done.get("cpu_affinity_cores")}


def power_view(control: Any) -> dict[str, Any] | None:
    """The first screen's one power line (replay_control.json's stopping.power): how many
    changes are undecided (0: the budget decided every one), the timing that would decide them
    at ±decide_within, and the key."""
    stopping = control.get("stopping") if isinstance(control, Mapping) else None
    power = stopping.get("power") if isinstance(stopping, Mapping) else None
    if not isinstance(power, Mapping):
        return None
    return {
        "undecided": len(power.get("undecided") or []),
        "seconds": finite(power.get("seconds_to_decide")),
        "target_pp": 100 * float(power.get("target_half_width") or 0.05),
        "key": power.get("key"),
        "budget_s": finite(power.get("configured_budget_s", stopping.get("budget_s"))),
    }


def replay_measurement_notes(control: Any) -> dict[str, Any]:
    """From replay_control.json: the instrument's CV and what was done, the coverage control's
    figure and why the timing stopped (None each where the JSON does not carry it)."""
    control = control if isinstance(control, Mapping) else {}
    instrument, coverage = control.get("instrument"), control.get("coverage")
    out: dict[str, Any] = {
        "instrument": None,
        "coverage": None,
        "stopping": None,
        "first_round": None,
    }
    if isinstance(instrument, Mapping) and finite(instrument.get("cv")) is not None:
        done = instrument.get("done") or {}
        out["instrument"] = {
            "cv": finite(instrument.get("cv")),
            "repeats": instrument.get("repeats"),
            "done": (
                f"{done.get('warmup')} warm-up, gc {done.get('gc')}, "
                f"{done.get('threads')} thread(s), {done.get('pinning')}"
            ),
        }
    if isinstance(coverage, Mapping):
        observed = coverage.get("observed") or {}
        out["coverage"] = {
            "min": finite(observed.get("min_coverage")),
            "per_strategy": observed.get("coverage"),
            "replications": (coverage.get("expected") or {}).get("replications"),
            "passed": bool(coverage.get("passed")),
            "verdict": coverage.get("verdict", "passed" if coverage.get("passed") else "failed"),
            "max_width_pp": (coverage.get("expected") or {}).get("max_width_pp"),
            "widest_pp": max((observed.get("mean_width_pp") or {}).values(), default=None),
        }
    if isinstance(control.get("stopping"), Mapping):
        out["stopping"] = dict(control["stopping"])
        out["first_round"] = first_round_view(out["stopping"])
    out["combined"] = combined_view(control.get("combined"))
    return out


def combined_view(record: Any) -> dict[str, Any] | None:
    """The combined configuration as the replay recorded it (probes.replay.combined): its name
    where it was timed (the table gives its title), else why not; None where the record is
    absent (an older replay)."""
    if not isinstance(record, Mapping) or "measured" not in record:
        return None
    if record["measured"]:
        return {"measured": True, "strategy": str(record.get("strategy"))}
    return {"measured": False, "why": str(record.get("why") or "not recorded")}


# the sizing model's first-round time against the round's measured one: outside these ratios the
# report says they disagree (the model prices every micro-batch as a new, warmed shape)
FIRST_ROUND_AGREES = (0.8, 1.25)


def first_round_view(stopping: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first round as sized (probes.replay.strata.sized_strata) and as measured: its
    strata, whether sizing cut them (and to the floor, still predicted past the budget), and
    whether the sizing model's predicted seconds and the round's measured ones disagree."""
    sizing = stopping.get("first_round")
    if not isinstance(sizing, Mapping):
        return None
    predicted = finite(sizing.get("first_round_predicted_s"))
    measured = finite(stopping.get("first_round_s"))
    budget = finite(stopping.get("budget_s"))
    ratio = measured / predicted if measured is not None and predicted else None
    low, high = FIRST_ROUND_AGREES
    return {
        "strata": sizing.get("strata"),
        "strata_configured": sizing.get("strata_configured"),
        "cut": (sizing.get("strata") or 0) < (sizing.get("strata_configured") or 0),
        "floor": predicted is not None and budget is not None and predicted > budget,
        "unit_s": finite(sizing.get("unit_s")),
        "predicted_s": predicted,
        "measured_s": measured,
        "disagrees": ratio is not None and not low <= ratio <= high,
    }


def host_bound_threshold(jsons: Mapping[str, Any]) -> float | None:
    """The host-bound threshold the replay applied (replay.host_bound_threshold of its config)."""
    control = (jsons or {}).get("replay_control") or {}
    return finite(control.get("host_bound_threshold"))


def host_bound_note(frame: pd.DataFrame, threshold: float | None) -> dict[str, Any] | None:
    """On CUDA: the share of sampled micro-batches that were host-bound, per strategy."""
    if "host_bound_share" not in frame:
        return None
    shares = {
        str(r["strategy"]): finite(r["host_bound_share"])
        for _, r in frame.iterrows()
        if finite(r["host_bound_share"]) is not None
    }
    if not shares:
        return None
    return {"threshold": threshold, "shares": shares, "c_meaning": C_MEANING}


TOKENS_NOT_TIME = (
    "saves {share} of the tokens the model computes over, which this device's time cannot show"
)


def token_saving(row: Mapping[str, Any], base: Mapping[str, Any]) -> float | None:
    """1 − computed tokens / random's: the padded-token saving, exact (not a measurement)."""
    tokens, base_tokens = finite(row.get("computed_tokens")), finite(base.get("computed_tokens"))
    if tokens is None or not base_tokens:
        return None
    return 1.0 - tokens / base_tokens


def tokens_not_time(saving: Mapping[str, Any] | None, verdict_text: str) -> str | None:
    """Said where a change saves padded tokens but its measured time ties with random."""
    share = finite((saving or {}).get("computed_token_saving"))
    if share is None or share <= 0.005 or verdict_text.startswith(("faster", "recommended")):
        return None
    return TOKENS_NOT_TIME.format(share=fmt_pct(share))


def change_measurement(
    change: Mapping[str, Any], tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]
) -> dict[str, Any] | None:
    """The replay's measured saving of one change of recommendations.json, or None when the
    replay did not measure that change (then the report gives the estimate, labelled)."""
    strategy = CHANGE_STRATEGY.get(str(change.get("id")))
    if strategy is None and change.get("step_level"):
        strategy = str(change.get("id"))  # a step-level change is its own strategy
    if strategy is None or replay_problem(tables, not_run):
        return None
    rows = tables["replay_estimates"]
    rows = rows[rows["strategy"] == strategy]
    if rows.empty:
        return None
    row = _row_dict(rows.iloc[0])
    base = tables["replay_estimates"]
    base = base[base["strategy"] == RANDOM]
    return {
        "computed_token_saving": token_saving(row, _row_dict(base.iloc[0]) if len(base) else {}),
        "source": "measured",
        "saving": finite(row["saving_vs_random"]),
        "saving_low": finite(row["saving_ci_low"]),
        "saving_high": finite(row["saving_ci_high"]),
        "valid": bool(row["valid"]),
        "invalid_reason": row.get("invalid_reason"),
        "cpu_only": bool(row["cpu_only"]),
        "baseline": "random batches",
    }


def replay_fit(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> dict | None:
    """The replay's scaling fit (a, b, c with intervals, its measured range) for Scaling."""
    if "replay" in not_run or tables["replay_fit"].empty:
        return None
    row = _row_dict(tables["replay_fit"].iloc[0])
    keys = (
        "a", "b", "c", "a_ci_low", "a_ci_high", "b_ci_low", "b_ci_high", "c_ci_low",
        "c_ci_high", "range_low", "range_high", "n_points", "rows", "r_squared",
        "residual_rms_s", "max_rel_residual", "resamples",
    )  # fmt: skip
    fit = {k: finite(row.get(k)) for k in keys}
    for text in ("method", "message", "lengths_source", "time_basis"):
        fit[text] = row.get(text)
    fit["cpu_only"] = bool(row.get("cpu_only"))
    return fit


def host_bound_overall(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict | None:
    """Over every sampled micro-batch whose GPU busy share was recorded (CUDA only): the share
    the replay labelled host-bound (its `host_bound` column, at its configured threshold)."""
    if "replay" in not_run or tables["replay_steps"].empty:
        return None
    steps = tables["replay_steps"]
    if "gpu_busy_share" not in steps:
        return None
    recorded = pd.to_numeric(steps["gpu_busy_share"], errors="coerce").notna()
    if not recorded.any():
        return None
    busy = pd.to_numeric(steps["gpu_busy_share"], errors="coerce")[recorded]
    return {
        "n": int(recorded.sum()),
        "host_bound_share": float(steps.loc[recorded, "host_bound"].astype(bool).mean()),
        "median_busy": float(busy.median()),
        "threshold": host_bound_threshold(jsons),
        "c_meaning": C_MEANING,
    }
