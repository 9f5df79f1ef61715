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
from fractions import Fraction
from itertools import permutations
from typing import Any

import numpy as np
import pandas as pd

from probes.batch_metrics import batch_slots
from probes.contracts import EMPTY, ERROR, OK, STATUSES, TRAINING_STATUSES, TRUNCATED

WASTE_STRATEGIES = ("pad_to_max_seq_len", "dataset_order", "random", "sorted")
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

    pad_to_max_seq_len: every row padded to max_seq_len. dataset_order: pad to the batch's longest,
    data order. random: the same after a shuffle; value/std/min/max over `seeds`, `expected` the
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
            "pad_to_max_seq_len": n * max_seq_len**power,
            "dataset_order": batch_slots(lengths, micro_batch_size, power),
            "sorted": batch_slots(np.sort(lengths), micro_batch_size, power),
        }
        for strategy in WASTE_STRATEGIES:
            if strategy == "random":
                per_seed = []
                slots_per_seed = []
                for seed in seeds:
                    order = np.random.default_rng(seed).permutation(n)
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


# --- positive control -------------------------------------------------------------------------
# A synthetic set whose lengths and waste are worked out by hand below; the stage must reproduce
# every number exactly before it is trusted with real data.
CONTROL_MAX_SEQ_LEN = 16
# (status from the loader, full tokens, loss tokens in full, loss tokens in the first 16)
CONTROL_ROWS = (
    (OK, 2, 1, 1),
    (OK, 24, 12, 6),  # longer than 16: TRUNCATED, 8 tokens lost, 6 loss tokens lost
    (OK, 4, 2, 2),
    (OK, 8, 4, 4),
    (EMPTY, 0, 0, 0),
    (OK, 4, 2, 2),
    (ERROR, 0, 0, 0),
    (OK, 8, 4, 4),
)
# Usable kept lengths in data order: [2, 16, 4, 8, 4, 8]; sum 42, sum of squares 420.
# Sorted: [2, 4, 4, 8, 8, 16]. E[max of a random 2-subset] = (1*4 + 2*4 + 3*8 + 4*8 + 5*16) / 15
# = 148/15, of its square 1776/15; of a random 4-subset (C(j-1,3)/15) = (1*8 + 4*8 + 10*16) / 15
# = 200/15, squared 2880/15.
CONTROL_EXPECTED = {
    "status_counts": {OK: 5, EMPTY: 1, ERROR: 1, TRUNCATED: 1},
    "tokens_lost": 8,
    "loss_tokens_lost": 6,
    "real": {"token_waste": 42, "attention_waste": 420},
    # batch size -> metric -> strategy -> padded slots (random: exact expectation as a fraction)
    "slots": {
        2: {
            "token_waste": {
                "pad_to_max_seq_len": 96,  # 6 * 16
                "dataset_order": 64,  # (2,16)(4,8)(4,8): 2*16 + 2*8 + 2*8
                "sorted": 56,  # (2,4)(4,8)(8,16): 2*4 + 2*8 + 2*16
                "random": (888, 15),  # 3 batches * 2 rows * 148/15
            },
            "attention_waste": {
                "pad_to_max_seq_len": 1536,  # 6 * 256
                "dataset_order": 768,  # 2*256 + 2*64 + 2*64
                "sorted": 672,  # 2*16 + 2*64 + 2*256
                "random": (10656, 15),  # 6 * 1776/15
            },
        },
        4: {
            "token_waste": {
                "pad_to_max_seq_len": 96,
                "dataset_order": 80,  # (2,16,4,8)(4,8): 4*16 + 2*8
                "sorted": 64,  # (2,4,4,8)(8,16): 4*8 + 2*16
                "random": (1096, 15),  # 4 * 200/15 + 2 * 148/15
            },
            "attention_waste": {
                "pad_to_max_seq_len": 1536,
                "dataset_order": 1152,  # 4*256 + 2*64
                "sorted": 768,  # 4*64 + 2*256
                "random": (15072, 15),  # 4 * 2880/15 + 2 * 1776/15
            },
        },
    },
    # numpy linear percentiles of [2, 4, 4, 8, 8, 16]
    "distribution": {"count": 6, "tokens": 42, "p50": 6.0, "p90": 12.0, "p99": 15.6, "max": 16},
    # V=262144, H=640, B*T=8192: ceil(V/H)=410, ceil(8192/410)=20, next_pow2 -> 32 tokens;
    # 2 GiB / (262144 * 10 B) = 819.2 -> 819 tokens.
    "ce": {"liger_chunk_tokens": 32, "chunk_tokens": 819},
}


def brute_force_random_slots(lengths: Sequence[int], batch_size: int, power: int) -> Fraction:
    """Mean padded slots over every order of a small set, as an exact fraction."""
    orders = list(permutations(lengths))
    total = sum(batch_slots(np.asarray(order), batch_size, power) for order in orders)
    return Fraction(total, len(orders))


def _check(name: str, expected: Any, observed: Any, passed: bool) -> dict[str, Any]:
    return {"name": name, "expected": expected, "observed": observed, "passed": bool(passed)}


def synthetic_control(seeds: Sequence[int] = (0, 1, 2)) -> list[dict[str, Any]]:
    """Run the synthetic set through the stage's own functions; one check per known value."""
    from probes.data import Example
    from probes.tokenize import lengths_table

    examples = [
        Example(f"control{i}", "control.jsonl", i + 1, f"s{i % 2}", status, n_turns=2)
        for i, (status, *_rest) in enumerate(CONTROL_ROWS)
    ]
    columns = np.asarray([row[1:] for row in CONTROL_ROWS], dtype=np.int64)
    lengths = lengths_table(
        examples, columns[:, 0], columns[:, 1], columns[:, 2], set(), CONTROL_MAX_SEQ_LEN
    )
    want = CONTROL_EXPECTED
    checks = []
    counts = lengths["status"].value_counts().to_dict()
    counts = {status: int(counts.get(status, 0)) for status in want["status_counts"]}
    checks.append(
        _check("status_counts", want["status_counts"], counts, counts == want["status_counts"])
    )
    truncated = lengths[lengths["status"] == TRUNCATED]
    lost = int(truncated["n_truncated_tokens"].sum())
    loss_lost = int((truncated["n_loss_tokens_full"] - truncated["n_loss_tokens"]).sum())
    checks.append(_check("tokens_lost", want["tokens_lost"], lost, lost == want["tokens_lost"]))
    checks.append(
        _check(
            "loss_tokens_lost",
            want["loss_tokens_lost"],
            loss_lost,
            loss_lost == want["loss_tokens_lost"],
        )
    )

    usable = usable_lengths(lengths)
    for batch_size, by_metric in want["slots"].items():
        summary = summary_table(lengths, batch_size, CONTROL_MAX_SEQ_LEN, seeds)
        waste = summary[summary["section"] == "waste"].set_index(["metric", "strategy"])
        for metric, by_strategy in by_metric.items():
            real = want["real"][metric]
            for strategy, slots in by_strategy.items():
                row = waste.loc[(metric, strategy)]
                name = f"B={batch_size} {metric} {strategy}"
                if strategy == "random":
                    exact = Fraction(*slots)
                    expected_waste = float(1 - Fraction(real) / exact)
                    brute = brute_force_random_slots(usable, batch_size, WASTE_METRICS[metric])
                    checks.append(
                        _check(
                            f"{name} expected waste",
                            expected_waste,
                            float(row["expected"]),
                            math.isclose(row["expected"], expected_waste, rel_tol=1e-12)
                            and brute == exact,
                        )
                    )
                else:
                    observed = (int(row["real"]), int(row["slots"]))
                    checks.append(
                        _check(
                            f"{name} real/slots",
                            [real, slots],
                            list(observed),
                            observed == (real, slots)
                            and math.isclose(row["value"], 1 - real / slots, rel_tol=1e-12),
                        )
                    )

    distribution = distribution_table(lengths, n_bins=8, max_sources=10)
    overall = distribution[
        (distribution["scope"] == "overall")
        & (distribution["measure"] == "n_tokens")
        & (distribution["kind"] == "stat")
    ].set_index("statistic")["value"]
    observed_dist = {key: float(overall[key]) for key in want["distribution"]}
    checks.append(
        _check(
            "distribution n_tokens",
            want["distribution"],
            observed_dist,
            all(
                math.isclose(observed_dist[k], v, rel_tol=1e-12)
                for k, v in want["distribution"].items()
            ),
        )
    )
    bins = distribution[
        (distribution["scope"] == "overall")
        & (distribution["measure"] == "n_tokens")
        & (distribution["kind"] == "bin")
    ]
    checks.append(
        _check(
            "histogram holds every example", 6, int(bins["value"].sum()), bins["value"].sum() == 6
        )
    )

    ce = ce_chunk_rows({"control": 4096}, 2, {"control": 262144}, 640, 2.0).iloc[0]
    observed_ce = {
        "liger_chunk_tokens": int(ce["liger_chunk_tokens"]),
        "chunk_tokens": int(ce["chunk_tokens"]),
    }
    checks.append(_check("ce chunk sizing", want["ce"], observed_ce, observed_ce == want["ce"]))
    return checks
