"""Length distribution, padding waste and cross-entropy chunk sizing, from the lengths table.

Pure functions from arrays/dataframes to dataframes. Waste is reported twice: token waste
(1 - real tokens / padded slots) and attention waste (the same with squared lengths, because
attention cost grows with the square of the padded length).

Batching model: a micro-batch of B examples is padded to its longest member; examples are taken
in order, B at a time, and the last batch may hold fewer (drop_last=False).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from probes.batching.metrics import batch_slots
from probes.batching.orders import seeded_permutation
from probes.contracts import (
    DATASET_ORDER,
    PAD_TO_MAX_SEQ_LEN,
    RANDOM,
    SORTED,
    STATUSES,
    TRAINING_STATUSES,
    TRUNCATED,
)

WASTE_STRATEGIES = (PAD_TO_MAX_SEQ_LEN, DATASET_ORDER, RANDOM, SORTED)
WASTE_METRICS = {"token_waste": 1, "attention_waste": 2}  # metric -> power of the length
PERCENTILES = {"p50": 50, "p90": 90, "p99": 99}
ALL_SOURCES = "(all)"
OTHER_SOURCES = "(other)"
DISTRIBUTION_MEASURES = ("n_tokens", "n_tokens_full", "n_loss_tokens")
GIB = 1024**3

# CE memory accounting per logit element (bytes): the stock path keeps the bf16 logits, upcasts
# them to an fp32 copy, and backward produces an fp32 gradient of the same shape.
BF16, FP32 = 2, 4
STOCK_BYTES_PER_LOGIT = BF16 + FP32 + FP32

SUMMARY_COLUMNS = (
    "section",
    "strategy",
    "status",
    "reason",
    "metric",
    "value",
    "std",
    "min",
    "max",
    "expected",
    "n_seeds",
    "real",
    "slots",
    "n_examples",
    "n_batches",
    "micro_batch_size",
    "max_seq_len",
)


def usable_lengths(lengths: pd.DataFrame) -> np.ndarray:
    """Kept token counts of the examples training would see (OK and TRUNCATED), in data order."""
    mask = lengths["status"].isin(TRAINING_STATUSES).to_numpy()
    return lengths.loc[mask, "n_tokens"].to_numpy(dtype=np.int64)


def expected_subset_max(sorted_lengths: np.ndarray, k: int, power: int = 1) -> float:
    """E[max(lengths of a uniformly random k-subset) ** power], exactly (order statistics).

    With values sorted ascending v_1..v_N, P(max is v_j) = C(j-1, k-1) / C(N, k).
    """
    values = np.asarray(sorted_lengths, dtype=np.float64)
    n = len(values)
    if k <= 0 or k > n:
        raise ValueError(f"subset size {k} out of range for {n} values")
    j = np.arange(k, n + 1, dtype=np.float64)
    log_weight = (
        _lgamma(j) - _lgamma(j - k + 1) - math.lgamma(k) - _log_comb(n, k)
    )  # log C(j-1, k-1) - log C(n, k)
    return float(np.sum(np.exp(log_weight) * values[k - 1 :] ** power))


def _lgamma(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.lgamma, otypes=[np.float64])(x)


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def expected_random_slots(lengths: np.ndarray, batch_size: int, power: int = 1) -> float:
    """E[padded slots] over uniformly random orders (shuffle, then batch), exactly.

    By linearity: each full batch is a uniformly random B-subset and the last partial batch a
    uniformly random r-subset, whatever the other batches hold.
    """
    values = np.sort(np.asarray(lengths, dtype=np.int64))
    n = len(values)
    if n == 0:
        return 0.0
    n_batches_full, remainder = divmod(n, batch_size)
    total = 0.0
    if n_batches_full:
        total += n_batches_full * batch_size * expected_subset_max(values, batch_size, power)
    if remainder:
        total += remainder * expected_subset_max(values, remainder, power)
    return total


def _waste(real: float, slots: float) -> float:
    return 1.0 - real / slots if slots else float("nan")


def waste_rows(
    lengths: np.ndarray, micro_batch_size: int, max_seq_len: int, seeds: Sequence[int]
) -> list[dict[str, Any]]:
    """Token and attention waste for each batching strategy (SUMMARY_COLUMNS rows).

    pad_to_max_seq_len: every row padded to max_seq_len. dataset_order: pad to the batch's
    longest, data order. random: the same after HF's shuffle (``seeded_permutation``, the
    bucket sweep's and the replay's `random`); value/std/min/max over `seeds`, `expected` the
    exact expectation 1 - real / E[slots] (the waste of many epochs pooled). sorted: after a
    global length sort (the best pad-to-longest can do at this batch size).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    n_batches = -(-n // micro_batch_size)
    rows = []
    for metric, power in WASTE_METRICS.items():
        real = int(np.sum(lengths**power))
        base = {
            "section": "waste",
            "metric": metric,
            "real": float(real),
            "n_examples": n,
            "n_batches": n_batches,
            "micro_batch_size": micro_batch_size,
            "max_seq_len": max_seq_len,
        }
        deterministic = {
            PAD_TO_MAX_SEQ_LEN: n * max_seq_len**power,
            DATASET_ORDER: batch_slots(lengths, micro_batch_size, power),
            SORTED: batch_slots(np.sort(lengths), micro_batch_size, power),
        }
        for strategy in WASTE_STRATEGIES:
            if strategy == RANDOM:
                per_seed = []
                slots_per_seed = []
                for seed in seeds:
                    # HF's shuffle, the same `random` as the bucket sweep's and the replay's
                    order = seeded_permutation(n, seed)
                    slots = batch_slots(lengths[order], micro_batch_size, power)
                    slots_per_seed.append(slots)
                    per_seed.append(_waste(real, slots))
                values = np.asarray(per_seed)
                expected_slots = expected_random_slots(lengths, micro_batch_size, power)
                rows.append(
                    {
                        **base,
                        "strategy": strategy,
                        "value": float(values.mean()),
                        "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                        "min": float(values.min()),
                        "max": float(values.max()),
                        "expected": _waste(real, expected_slots),
                        "n_seeds": len(values),
                        "slots": float(np.mean(slots_per_seed)),
                    }
                )
            else:
                slots = deterministic[strategy]
                value = _waste(real, slots)
                rows.append(
                    {
                        **base,
                        "strategy": strategy,
                        "value": value,
                        "std": 0.0,
                        "min": value,
                        "max": value,
                        "expected": value,
                        "n_seeds": 1,
                        "slots": float(slots),
                    }
                )
    return rows


def status_rows(lengths: pd.DataFrame) -> list[dict[str, Any]]:
    """Every status its own rows (count, fraction; tokens lost for TRUNCATED) and reason counts."""
    total = len(lengths)
    rows = []
    for status in STATUSES:
        subset = lengths[lengths["status"] == status]
        count = len(subset)
        rows.append({"section": "status", "status": status, "metric": "count", "value": count})
        rows.append(
            {
                "section": "status",
                "status": status,
                "metric": "fraction",
                "value": count / total if total else float("nan"),
            }
        )
        if status == TRUNCATED:
            rows.append(
                {
                    "section": "status",
                    "status": status,
                    "metric": "tokens_lost",
                    "value": int(subset["n_truncated_tokens"].sum()),
                }
            )
            if "n_loss_tokens_full" in subset:
                lost = subset["n_loss_tokens_full"] - subset["n_loss_tokens"]
                rows.append(
                    {
                        "section": "status",
                        "status": status,
                        "metric": "loss_tokens_lost",
                        "value": int(lost.sum()),
                    }
                )
    reasons = (
        lengths[lengths["reason"] != ""].groupby(["status", "reason"]).size().reset_index(name="n")
    )
    for record in reasons.itertuples(index=False):
        rows.append(
            {
                "section": "reason",
                "status": record.status,
                "reason": record.reason,
                "metric": "count",
                "value": int(record.n),
            }
        )
    return rows


def summary_table(
    lengths: pd.DataFrame, micro_batch_size: int, max_seq_len: int, seeds: Sequence[int]
) -> pd.DataFrame:
    """summary.parquet: waste rows (section=waste) then status and reason rows."""
    rows = waste_rows(usable_lengths(lengths), micro_batch_size, max_seq_len, seeds)
    rows += status_rows(lengths)
    frame = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    for column in ("strategy", "status", "reason"):
        frame[column] = frame[column].fillna("").astype(str)
    for column in ("value", "std", "min", "max", "expected", "real", "slots"):
        frame[column] = frame[column].astype(float)
    for column in ("n_seeds", "n_examples", "n_batches", "micro_batch_size", "max_seq_len"):
        frame[column] = frame[column].astype("Int64")
    return frame


def log_bin_edges(max_value: int, n_bins: int) -> np.ndarray:
    """Log-spaced edges from 1 to max_value + 1 (bins are [lo, hi); zeros are counted apart)."""
    return np.geomspace(1.0, max(float(max_value), 1.0) + 1.0, n_bins + 1)


def _stats(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        empty = {"count": 0.0, "tokens": 0.0, "mean": np.nan, "min": np.nan, "max": np.nan}
        return empty | {"n_zero": 0.0} | {name: np.nan for name in PERCENTILES}
    stats = {
        "count": float(len(values)),
        "tokens": float(values.sum()),
        "mean": float(values.mean()),
        "min": float(values.min()),
        "max": float(values.max()),
        "n_zero": float(np.sum(values == 0)),
    }
    for name, q in PERCENTILES.items():
        stats[name] = float(np.percentile(values, q))  # numpy's default linear interpolation
    return stats


def distribution_table(lengths: pd.DataFrame, n_bins: int, max_sources: int) -> pd.DataFrame:
    """distribution.parquet, long format, over usable (OK and TRUNCATED) examples.

    One row per (scope, source, measure, kind, statistic/bin). scope 'overall' has source '(all)';
    scope 'source' has each source, the `max_sources` largest by count by name, the rest pooled as
    '(other)'. kind 'stat' rows: statistic in count, tokens, mean, min, p50, p90, p99, max,
    n_zero. kind 'bin' rows: statistic 'bin', bin_index, [bin_lo, bin_hi) log-spaced edges shared
    by every source of a measure, value = examples in the bin (zeros only in n_zero).
    """
    usable = lengths[lengths["status"].isin(TRAINING_STATUSES)]
    counts = usable["source"].value_counts()
    keep = set(counts.index[:max_sources])
    source = usable["source"].where(usable["source"].isin(keep), OTHER_SOURCES)
    groups: list[tuple[str, str, pd.Index]] = [("overall", ALL_SOURCES, usable.index)]
    for name in sorted(source.unique(), key=lambda s: (s == OTHER_SOURCES, -counts.get(s, 0), s)):
        groups.append(("source", name, usable.index[(source == name).to_numpy()]))

    rows = []
    for measure in DISTRIBUTION_MEASURES:
        column = usable[measure].to_numpy(dtype=np.int64)
        edges = log_bin_edges(int(column.max(initial=0)), n_bins)
        by_label = pd.Series(column, index=usable.index)
        for scope, name, index in groups:
            values = by_label.loc[index].to_numpy(dtype=np.int64)
            base = {"scope": scope, "source": name, "measure": measure}
            for statistic, value in _stats(values).items():
                rows.append({**base, "kind": "stat", "statistic": statistic, "value": value})
            hist, _ = np.histogram(values[values > 0], bins=edges)
            for i, count in enumerate(hist):
                rows.append(
                    {
                        **base,
                        "kind": "bin",
                        "statistic": "bin",
                        "bin_index": i,
                        "bin_lo": float(edges[i]),
                        "bin_hi": float(edges[i + 1]),
                        "value": float(count),
                    }
                )
    frame = pd.DataFrame(
        rows,
        columns=[
            "scope",
            "source",
            "measure",
            "kind",
            "statistic",
            "bin_index",
            "bin_lo",
            "bin_hi",
            "value",
        ],
    )
    frame["bin_index"] = frame["bin_index"].astype("Int64")
    for column in ("bin_lo", "bin_hi", "value"):
        frame[column] = frame[column].astype(float)
    return frame


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def liger_chunk_size(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Liger fused-linear-CE's chunk: next_pow2(ceil(BT / ceil(V / H))), so that a chunk of
    logits is about as large as the BT x H hidden states."""
    inc_factor = -(-vocab_size // hidden_size)
    return next_pow2(-(-tokens // inc_factor))


def ce_chunk_rows(
    shapes: dict[str, int],
    micro_batch_size: int,
    vocab_sizes: dict[str, int],
    hidden_size: int,
    budget_gib: float,
) -> pd.DataFrame:
    """ce_chunks.parquet: one row per (shape, vocab source).

    Bytes per logit element follow STOCK_BYTES_PER_LOGIT (bf16 logits + fp32 upcast + fp32
    gradient); `chunk_tokens` is the largest token chunk whose logits and gradient (same
    accounting) fit the budget, capped at the batch's tokens; Liger's heuristic chunk beside it.
    """
    budget = int(budget_gib * GIB)
    rows = []
    for vocab_source, vocab in vocab_sizes.items():
        per_token = vocab * STOCK_BYTES_PER_LOGIT
        fit = budget // per_token
        for shape, seq_len in shapes.items():
            tokens = micro_batch_size * seq_len
            chunk = min(fit, tokens)
            liger = liger_chunk_size(tokens, vocab, hidden_size)
            rows.append(
                {
                    "shape": shape,
                    "micro_batch_size": micro_batch_size,
                    "seq_len": seq_len,
                    "tokens": tokens,
                    "vocab_source": vocab_source,
                    "vocab_size": vocab,
                    "hidden_size": hidden_size,
                    "logits_bf16_bytes": tokens * vocab * BF16,
                    "logits_fp32_bytes": tokens * vocab * FP32,
                    "stock_loss_bytes": tokens * vocab * STOCK_BYTES_PER_LOGIT,
                    "budget_gib": float(budget_gib),
                    "budget_bytes": budget,
                    "stock_fits_budget": tokens * per_token <= budget,
                    "chunk_tokens": int(chunk),
                    "n_chunks": -(-tokens // chunk) if chunk else 0,
                    "chunk_bytes": int(chunk) * per_token,
                    "liger_chunk_tokens": liger,
                    "liger_n_chunks": -(-tokens // liger),
                    "liger_chunk_bytes": min(liger, tokens) * per_token,
                    "liger_fits_budget": min(liger, tokens) * per_token <= budget,
                }
            )
    return pd.DataFrame(rows)


def ce_shapes(lengths: pd.DataFrame, max_seq_len: int) -> dict[str, int]:
    """Sequence lengths to size the CE at: the training shape and observed p50/p90/p99/max."""
    values = usable_lengths(lengths)
    shapes = {"max_seq_len": int(max_seq_len)}
    if len(values):
        for name, q in PERCENTILES.items():
            shapes[name] = int(math.ceil(np.percentile(values, q)))
        shapes["max"] = int(values.max())
    return shapes


def model_dims(model_config: dict[str, Any]) -> tuple[int, int | None]:
    """(hidden_size, vocab_size) from config.json; wrappers keep them in text_config."""
    text = model_config.get("text_config") or {}
    hidden = text.get("hidden_size", model_config.get("hidden_size"))
    vocab = text.get("vocab_size", model_config.get("vocab_size"))
    if hidden is None:
        raise ValueError("config.json has no hidden_size (nor text_config.hidden_size)")
    return int(hidden), (int(vocab) if vocab is not None else None)


def no_usable_files(lengths: pd.DataFrame) -> list[str]:
    """Files left with no usable example after tokenization (e.g. every row failed the template)."""
    usable = lengths["status"].isin(TRAINING_STATUSES)
    per_file = usable.groupby(lengths["file"]).any()
    return sorted(per_file.index[~per_file.to_numpy()])
