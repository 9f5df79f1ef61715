"""The report's derived numbers: the time model, expected savings and the ranked recommendations.

``workload_time`` prices a batching strategy from the profile's fit t(T) = a·T² + b·T + c and the
padding/bucket efficiencies; ``expected_saving`` and ``subset_saving`` turn two such prices into
the share of training time saved; ``recommendations`` ranks the changes the summary lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from probes.contracts import BATCH_REBALANCE, PACKING, RANDOM, TRAINING_STATUSES
from probes.report_format import finite, fmt_bytes, fmt_count, fmt_number, fmt_pct, fmt_tokens
from probes.report_load import diversity_level_name

MIN_IDLE_SHARE = 0.01  # examples without a loss token worth a recommendation from this share
TRAINING_SHAPE = "max_seq_len"  # the ce_chunks row sized at the training shape


@dataclass(frozen=True)
class StepFit:
    """t(T) = a·T² + b·T + c: seconds for one micro-batch of `batch` rows padded to T tokens."""

    a: float
    b: float
    c: float
    batch: int


def workload_time(
    fit: StepFit,
    sum_len: float,
    sum_len_sq: float,
    token_efficiency: float,
    attention_efficiency: float,
    n_micro_batches: float,
) -> float:
    """Seconds to run a dataset under one batching strategy, from the fit and its efficiencies.

    Summed over micro-batches j of `batch` rows padded to T_j:
      Σ a·T_j² = (a/B)·Σ B·T_j² = (a/B)·ΣL² / attention_efficiency
      Σ b·T_j  = (b/B)·Σ B·T_j  = (b/B)·ΣL  / token_efficiency
      Σ c      = c · n_micro_batches
    because the efficiencies are real over padded (squared) token slots. The profile's
    predicted padding penalty uses the same per-row reading of a and b.
    """
    return (
        fit.a / fit.batch * sum_len_sq / attention_efficiency
        + fit.b / fit.batch * sum_len / token_efficiency
        + fit.c * n_micro_batches
    )


@dataclass(frozen=True)
class Efficiency:
    token: float
    attention: float
    n_micro_batches: float


def expected_saving(
    baseline: Efficiency,
    candidate: Efficiency,
    fit: StepFit | None,
    sum_len: float,
    sum_len_sq: float,
) -> dict[str, float | None]:
    """Fraction of training time saved moving from `baseline` to `candidate` batching.

    With a fit: one number. Without one: the linear-cost and quadratic-cost limits (a step
    dominated by per-token work saves what token efficiency gains; one dominated by attention
    saves what attention efficiency gains); the true saving lies between them when c is small.
    """
    linear = 1 - baseline.token / candidate.token
    quadratic = 1 - baseline.attention / candidate.attention
    saving = None
    if fit is not None:
        before, after = (
            workload_time(fit, sum_len, sum_len_sq, e.token, e.attention, e.n_micro_batches)
            for e in (baseline, candidate)
        )
        saving = 1 - after / before if before > 0 else None
    return {"saving": saving, "linear_limit": linear, "quadratic_limit": quadratic}


def fit_problem(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> str | None:
    """Why the scaling fit cannot price the savings, or None when it can."""
    if "profile" in not_run:
        return f"the profile did not run ({not_run['profile']})"
    scaling, fit = tables["profile_scaling"], tables["profile_fit"]
    if fit.empty or (scaling["status"] == "OK").sum() == 0:
        return "the profile has no measured scaling point"
    row = fit.iloc[0]
    coeffs = {k: finite(row[k]) for k in ("a", "b", "c")}
    if (finite(row["n_points"]) or 0) < 3 or None in coeffs.values():
        return "the scaling fit has fewer than 3 usable points (three terms need three)"
    negative = [f"{k} = {fmt_number(v)}" for k, v in coeffs.items() if v is not None and v < 0]
    if negative:
        # a cost that shrinks with length: noise (a busy CPU, too few repeats), not a model
        return (
            f"the scaling fit has a negative coefficient ({', '.join(negative)}): it is not a "
            "cost that grows with length at the measured lengths"
        )
    return None


def usable_fit(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> StepFit | None:
    """The scaling fit when it can price savings (see fit_problem); else None."""
    if fit_problem(tables, not_run) is not None:
        return None
    row = tables["profile_fit"].iloc[0]
    scaling = tables["profile_scaling"]
    batch = int(scaling.loc[scaling["status"] == "OK", "batch"].iloc[0])
    return StepFit(float(row["a"]), float(row["b"]), float(row["c"]), batch=batch)


def training_lengths(lengths: pd.DataFrame) -> pd.Series:
    """Token counts of the examples that train (OK and TRUNCATED; EMPTY/ERROR never do)."""
    return lengths.loc[lengths["status"].isin(TRAINING_STATUSES), "n_tokens"].astype("float64")


def _efficiency(row: Mapping[str, Any]) -> Efficiency:
    return Efficiency(
        float(row["token_efficiency"]),
        float(row["attention_efficiency"]),
        float(row["n_micro_batches"]),
    )


def waste_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Waste rows of summary.parquet pivoted to one row per strategy: value and std per metric."""
    waste = summary[summary["section"] == "waste"]
    wide = waste.pivot_table(
        index="strategy", columns="metric", values=["value", "std"], aggfunc="first", sort=False
    )
    wide.columns = [f"{metric}_{stat}" for stat, metric in wide.columns]
    return wide.reset_index()


def subset_saving(
    fit: StepFit | None, before: pd.Series, after: pd.Series, efficiency: Efficiency
) -> dict[str, float | None]:
    """Fraction of training time saved by training on `after` instead of `before` (lengths),
    batched the same way (same efficiencies, micro-batches in proportion to examples)."""
    s1, s2 = float(before.sum()), float((before**2).sum())
    k1, k2 = float(after.sum()), float((after**2).sum())
    saving = None
    if fit is not None:
        per_example = efficiency.n_micro_batches / max(len(before), 1)
        full = workload_time(
            fit, s1, s2, efficiency.token, efficiency.attention, len(before) * per_example
        )
        part = workload_time(
            fit, k1, k2, efficiency.token, efficiency.attention, len(after) * per_example
        )
        saving = 1 - part / full if full > 0 else None
    return {
        "saving": saving,
        "linear_limit": 1 - k1 / s1 if s1 else None,
        "quadratic_limit": 1 - k2 / s2 if s2 else None,
    }


def no_loss_saving(
    tables: Mapping[str, pd.DataFrame], fit: StepFit | None
) -> dict[str, float | None] | None:
    """Training time saved by dropping the examples that train without a loss token (batched
    at random, micro-batches in proportion); None without the padding stage's random waste."""
    trains = tables["padding_lengths"]
    trains = trains[trains["status"].isin(TRAINING_STATUSES)]
    waste = waste_table(tables["padding_summary"])
    if trains.empty or waste.empty or RANDOM not in set(waste["strategy"]):
        return None
    waste = waste.set_index("strategy")
    random = Efficiency(
        1 - float(waste.loc[RANDOM, "token_waste_value"]),
        1 - float(waste.loc[RANDOM, "attention_waste_value"]),
        math.ceil(len(trains) / (fit.batch if fit else 1)),
    )
    tokens = trains["n_tokens"].astype("float64")
    idle = (trains["n_loss_tokens"] == 0).to_numpy()
    return subset_saving(fit, tokens, tokens[~idle], random)


def change_summary_row(change: Mapping[str, Any], summary: pd.DataFrame) -> pd.Series | None:
    """The bucket summary row a change of ``recommendations.json`` (probes.apply) was priced
    from: its bucket size (length grouping, HF's group_by_length), batch_rebalance's row, or the
    packing row it names; None for a change no row describes."""
    kind = change.get("id")
    if kind in ("length_grouped", "group_by_length_builtin"):
        rows = summary[
            (summary["bucket_size_batches"] == change.get("bucket_size_batches"))
            & ~summary["strategy"].str.startswith(PACKING)
        ]
    elif kind == BATCH_REBALANCE:
        rows = summary[summary["strategy"] == BATCH_REBALANCE]
    elif kind == PACKING:
        rows = summary[summary["strategy"] == (change.get("estimate") or {}).get("strategy")]
    else:
        return None
    return rows.iloc[0] if not rows.empty else None


def change_saving(
    change: Mapping[str, Any],
    tables: Mapping[str, pd.DataFrame],
    not_run: Mapping[str, str],
) -> dict[str, Any] | None:
    """The estimated saving of training time of one applicable change, against random batches
    (``expected_saving`` on its bucket summary row) or, for dropping examples without a loss
    token, against every example (``no_loss_saving``). None when nothing prices it. An estimate
    from token counts and the fit until a measured replay exists."""
    if not change.get("applies") or "padding" in not_run:
        return None
    fit = usable_fit(tables, not_run)
    if change.get("id") == "drop_no_loss_examples":
        saving = no_loss_saving(tables, fit)
        return None if saving is None else {**saving, "baseline": "every OK/TRUNCATED example"}
    if "bucket" in not_run:
        return None
    summary = tables["bucket_summary"]
    random = summary[summary["strategy"] == RANDOM]
    row = change_summary_row(change, summary)
    if row is None or random.empty:
        return None
    lengths = training_lengths(tables["padding_lengths"])
    return {
        **expected_saving(
            _efficiency(random.iloc[0]),
            _efficiency(row),
            fit,
            float(lengths.sum()),
            float((lengths**2).sum()),
        ),
        "baseline": "random batches",
    }


def _no_saving() -> dict[str, None]:
    return {"saving": None, "linear_limit": None, "quadratic_limit": None}


def recommendations(
    tables: Mapping[str, pd.DataFrame],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    limit: int = 4,
) -> list[dict[str, Any]]:
    """The top changes, each with its expected saving of training time and what it rests on.

    The `limit` best by expected saving (the fitted saving, else the midpoint of its limits),
    then changes that save memory rather than time (CE chunking).
    """
    fit = usable_fit(tables, not_run)
    recs: list[dict[str, Any]] = []
    lengths = (
        training_lengths(tables["padding_lengths"])
        if "padding" not in not_run
        else pd.Series(dtype="float64")
    )
    sum_len, sum_len_sq = float(lengths.sum()), float((lengths**2).sum())

    if "bucket" not in not_run and not tables["bucket_summary"].empty and len(lengths):
        # mean over seeds per strategy x bucket size, as the bucket stage wrote it
        means = tables["bucket_summary"]
        rec = jsons["bucket_recommendation"]
        random = means[means["strategy"] == RANDOM]
        size = finite((rec.get("recommended") or {}).get("bucket_size_batches"))
        chosen = means[means["bucket_size_batches"] == size]
        if not random.empty and size is not None and size > 1 and not chosen.empty:
            base, row = random.iloc[0], chosen.iloc[0]
            recs.append(
                {
                    "kind": "time",
                    "title": f"Group batches by length: buckets of {size:g} micro-batches",
                    "detail": (
                        f"token efficiency {fmt_pct(base['token_efficiency'])} → "
                        f"{fmt_pct(row['token_efficiency'])}; source diversity per "
                        f"{diversity_level_name(rec)} "
                        f"{fmt_pct(row['diversity_rel_random'], 0)} of random"
                    ),
                    "baseline": "random batches",
                    **expected_saving(
                        _efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq
                    ),
                }
            )
        packed = means[means["strategy"].str.startswith(PACKING)]
        if not random.empty and not packed.empty:
            base = random.iloc[0]
            row = packed.sort_values("token_efficiency", ascending=False).iloc[0]
            recs.append(
                {
                    "kind": "time",
                    "title": f"Pack whole examples into max_seq_len rows ({row['strategy']})",
                    "detail": (
                        f"token efficiency {fmt_pct(row['token_efficiency'])}, "
                        f"{fmt_count(row['n_micro_batches'])} micro-batches instead of "
                        f"{fmt_count(base['n_micro_batches'])}; attention counted dense (a varlen "
                        "kernel would do better); needs attention that keeps documents apart "
                        "(see the mask gate)"
                    ),
                    "baseline": "random batches",
                    **expected_saving(
                        _efficiency(base), _efficiency(row), fit, sum_len, sum_len_sq
                    ),
                }
            )

    if "padding" not in not_run and len(lengths):
        waste = waste_table(tables["padding_summary"]).set_index("strategy")
        needed = {"token_waste_value", "attention_waste_value"}
        if {"pad_to_max_seq_len", "random"} <= set(waste.index) and needed <= set(waste.columns):
            n_batches = math.ceil(len(lengths) / (fit.batch if fit else 1))

            def eff(name: str) -> Efficiency:
                return Efficiency(
                    1 - float(waste.loc[name, "token_waste_value"]),
                    1 - float(waste.loc[name, "attention_waste_value"]),
                    n_batches,
                )

            recs.append(
                {
                    "kind": "time",
                    "title": "Pad each batch to its longest member, not to max_seq_len",
                    "detail": (
                        "token waste "
                        f"{fmt_pct(waste.loc['pad_to_max_seq_len', 'token_waste_value'])} → "
                        f"{fmt_pct(waste.loc['random', 'token_waste_value'])}; applies only if "
                        "you pad to max_seq_len today"
                    ),
                    "baseline": "pad to max_seq_len",
                    **expected_saving(
                        eff("pad_to_max_seq_len"), eff("random"), fit, sum_len, sum_len_sq
                    ),
                }
            )

    if "padding" not in not_run and len(lengths):
        trains = tables["padding_lengths"]
        trains = trains[trains["status"].isin(TRAINING_STATUSES)]
        idle = (trains["n_loss_tokens"] == 0).to_numpy()
        saving = no_loss_saving(tables, fit)
        if idle.mean() >= MIN_IDLE_SHARE and saving is not None:
            tokens = trains["n_tokens"].astype("float64")
            recs.append(
                {
                    "kind": "time",
                    "title": (
                        f"Drop the {fmt_count(idle.sum())} examples that carry no loss token"
                    ),
                    "detail": (
                        f"{fmt_pct(idle.mean())} of the examples that train, "
                        f"{fmt_pct(tokens[idle].sum() / tokens.sum())} of their tokens: they cost "
                        "compute and teach nothing (check training.loss_on and truncation)"
                    ),
                    "baseline": "every OK/TRUNCATED example",
                    **saving,
                }
            )

    if "padding" not in not_run and not tables["padding_ce_chunks"].empty:
        chunks = tables["padding_ce_chunks"]
        train = chunks[chunks["shape"] == TRAINING_SHAPE]
        row = (train if not train.empty else chunks).iloc[0]
        fits = bool(row.get("stock_fits_budget", False))
        if not fits:
            recs.append(
                {
                    "kind": "memory",
                    "title": f"Chunk the cross-entropy: {fmt_tokens(row['chunk_tokens'])} a chunk",
                    "detail": (
                        f"at {fmt_count(row['tokens'])} tokens × {fmt_count(row['vocab_size'])} "
                        f"vocabulary the stock loss path holds {fmt_bytes(row['stock_loss_bytes'])}"
                        f"; {fmt_count(row['n_chunks'])} chunks stay within the budget; Liger's "
                        "heuristic "
                        f"picks {fmt_tokens(row['liger_chunk_tokens'])}"
                    ),
                    "baseline": "unchunked loss",
                    "memory_before": finite(row["stock_loss_bytes"]),
                    "memory_after": finite(row.get("chunk_bytes")),
                    **_no_saving(),
                }
            )

    def rank(rec: dict[str, Any]) -> float:
        if rec["saving"] is not None:
            return -rec["saving"]
        return -(rec["linear_limit"] + rec["quadratic_limit"]) / 2

    # the `limit` best time savings, then what saves memory rather than time
    timed = sorted((r for r in recs if r["kind"] == "time"), key=rank)[:limit]
    return timed + [r for r in recs if r["kind"] != "time"]
