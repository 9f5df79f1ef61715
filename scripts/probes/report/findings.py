"""The report's findings that the replay prices: what the padding and bucket stages found,
as titles and counts, never as a saving of time.

A saving of time is only ever the replay's measurement (``probes.report.sections.replay``). The
profile's
scaling fit is a diagnostic (``fit_problem`` says when it is not even that); nothing here turns it
or a token efficiency into a price.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import PACKING, RANDOM, TRAINER_DATASET_FILE, TRAINING_STATUSES
from probes.report.format import finite, fmt_bytes, fmt_count, fmt_number, fmt_pct, fmt_tokens
from probes.report.load import diversity_level_name
from probes.report.sections.padding import waste_table

MIN_IDLE_SHARE = 0.01  # examples without a loss token worth listing from this share
TRAINING_SHAPE = "max_seq_len"  # the ce_chunks row sized at the training shape


def fit_problem(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> str | None:
    """Why the profile's scaling fit is not a usable diagnostic, or None when it is."""
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


def recommendations(
    tables: Mapping[str, pd.DataFrame],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    limit: int = 4,
) -> list[dict[str, Any]]:
    """What the padding and bucket stages found, as titles and the counts they rest on (no
    saving of time: the replay measures those), in a fixed order, the first `limit` of them;
    then changes that save memory rather than time (CE chunking)."""
    trains = training_rows(tables, not_run)
    recs: list[dict[str, Any]] = []
    if "bucket" not in not_run and not tables["bucket_summary"].empty and len(trains):
        recs += bucket_findings(tables["bucket_summary"], jsons["bucket_recommendation"])
    if "padding" not in not_run and len(trains):
        # a user's trainer pads to the longest member already (its collator, checked)
        if not (trains["file"] == TRAINER_DATASET_FILE).all():
            recs.append(pad_to_longest_finding(tables["padding_summary"]))
        recs.append(idle_examples_finding(trains))
    if "padding" not in not_run and not tables["padding_ce_chunks"].empty:
        recs.append(ce_chunk_finding(tables["padding_ce_chunks"]))
    recs = [r for r in recs if r is not None]
    # no ranking without a measurement: the stages' order, then what saves memory, not time
    timed = [r for r in recs if r["kind"] == "time"][:limit]
    return timed + [r for r in recs if r["kind"] != "time"]


def training_rows(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> pd.DataFrame:
    """The padding stage's examples that train (empty when the padding stage did not run)."""
    if "padding" in not_run:
        return pd.DataFrame()
    lengths = tables["padding_lengths"]
    return lengths[lengths["status"].isin(TRAINING_STATUSES)]


def bucket_findings(means: pd.DataFrame, rec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The bucket sweep's findings: grouping by length at the recommended bucket size, and the
    best packing; `means` is the sweep's mean over seeds per strategy x bucket size."""
    random = means[means["strategy"] == RANDOM]
    if random.empty:
        return []
    base = random.iloc[0]
    found: list[dict[str, Any]] = []
    size = finite((rec.get("recommended") or {}).get("bucket_size_batches"))
    chosen = means[means["bucket_size_batches"] == size]
    if size is not None and size > 1 and not chosen.empty:
        row = chosen.iloc[0]
        found.append(
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
            }
        )
    packed = means[means["strategy"].str.startswith(PACKING)]
    if not packed.empty:
        row = packed.sort_values("token_efficiency", ascending=False).iloc[0]
        found.append(
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
            }
        )
    return found


def pad_to_longest_finding(padding_summary: pd.DataFrame) -> dict[str, Any] | None:
    """Padding to each batch's longest member instead of max_seq_len, from the waste table."""
    waste = waste_table(padding_summary).set_index("strategy")
    needed = {"token_waste_value", "attention_waste_value"}
    if not ({"pad_to_max_seq_len", "random"} <= set(waste.index) and needed <= set(waste.columns)):
        return None
    return {
        "kind": "time",
        "title": "Pad each batch to its longest member, not to max_seq_len",
        "detail": (
            "token waste "
            f"{fmt_pct(waste.loc['pad_to_max_seq_len', 'token_waste_value'])} → "
            f"{fmt_pct(waste.loc['random', 'token_waste_value'])}; applies only if "
            "you pad to max_seq_len today"
        ),
        "baseline": "pad to max_seq_len",
    }


def idle_examples_finding(trains: pd.DataFrame) -> dict[str, Any] | None:
    """Dropping the examples that carry no loss token, once they are MIN_IDLE_SHARE or more."""
    idle = (trains["n_loss_tokens"] == 0).to_numpy()
    if idle.mean() < MIN_IDLE_SHARE:
        return None
    tokens = trains["n_tokens"].astype("float64")
    return {
        "kind": "time",
        "title": f"Drop the {fmt_count(idle.sum())} examples that carry no loss token",
        "detail": (
            f"{fmt_pct(idle.mean())} of the examples that train, "
            f"{fmt_pct(tokens[idle].sum() / tokens.sum())} of their tokens: they cost "
            "compute and teach nothing (check training.loss_on and truncation)"
        ),
        "baseline": "every OK/TRUNCATED example",
    }


def ce_chunk_finding(chunks: pd.DataFrame) -> dict[str, Any] | None:
    """Chunking the cross-entropy at the training shape, when the stock loss path does not fit
    the budget (a change that saves memory, not time)."""
    train = chunks[chunks["shape"] == TRAINING_SHAPE]
    row = (train if not train.empty else chunks).iloc[0]
    if bool(row.get("stock_fits_budget", False)):
        return None
    return {
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
    }
