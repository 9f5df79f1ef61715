"""Bucket sweep: what length-grouped batching saves, at which bucket size, at what diversity cost.

Strategies, all measured on the same tokenised lengths (``results/padding/lengths.parquet``):

- ``random``: shuffled micro-batches (bucket size 1 micro-batch);
- ``length_grouped``: Hugging Face's ``get_length_grouped_indices`` semantics
  (``probes.batching.orders.length_grouped_order``) with a bucket of ``m`` micro-batches;
- ``global_sort``: the same with one megabatch holding the whole dataset;
- ``packing_bfd``: whole examples packed into ``max_seq_len`` rows by TRL's own
  ``pack_dataset(strategy="bfd")`` (``probes.batching.packing``), rows shuffled,
  ``micro_batch_size`` rows per micro-batch.

Every row carries the metrics of ``probes.batching.metrics``, and diversity also relative to random
batching with the same seed (1.0 when random has nothing to lose, e.g. one-source data). Here: the
sweep, its summary over seeds, the collapse guard and the recommendation; the positive controls
are in ``probes.bucket.control``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from probes.batching.metrics import packed_metrics, padded_metrics
from probes.batching.orders import (
    HF_MAX_MEGA_BATCH_MULT,
    OrderFn,
    all_bucket_size,
    hf_trainer_mega_batch_mult,
    length_grouped_order,
    seeded_permutation,
    sweep_bucket_sizes_for,
)
from probes.batching.packing import PACKING_STRATEGIES, PackedRows, pack_all
from probes.contracts import BATCH_REBALANCE, STRATEGY_ORDER
from probes.lengths import LengthSet

ATTENTION_NOTE = (
    "attention efficiency = sum of squared example lengths / rows x padded length squared: what a "
    "dense kernel (SDPA/eager with a padding or block-diagonal mask) computes. A varlen kernel "
    "(flash-attn cu_seqlens, padding-free) spends only the useful part on padded and packed "
    "batches alike, which would make packing's attention efficiency 1.0."
)


# --------------------------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------------------------

RELATIVE_COLUMNS = (
    "micro_distinct_sources",
    "micro_source_entropy",
    "step_distinct_sources",
    "step_source_entropy",
)


def _strategy_name(m: int, m_all: int) -> str:
    if m == 1:
        return "random"
    return "global_sort" if m == m_all else "length_grouped"


def sweep_bucket_sizes(
    data: LengthSet,
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    seeds: Sequence[int],
    bucket_sizes: Iterable[int] | None = None,
    packing: Sequence[str] = PACKING_STRATEGIES,
    order_fn: OrderFn = length_grouped_order,
    progress: bool = False,
    batch_rebalance: bool = True,
    packed: Mapping[str, PackedRows] | None = None,
) -> pd.DataFrame:
    """One row per strategy × bucket size × seed (packing: per strategy × seed).

    Every bucket size of one seed shares that seed's shuffle, as HF's sampler would (its shuffle
    does not depend on mega_batch_mult), so differences between sizes are not shuffle noise.
    ``batch_rebalance`` adds a comparison row per seed from transformers' own
    BatchRebalanceSampler (``probes.batching.rebalance``; same shuffle as the seed's), where the
    installed transformers has it and there are at least ``grad_accum`` examples
    (``rebalance.skip_reason`` says why not). It has no bucket size: the guard and the
    recommendation skip it. ``packed``: the rows of each ``packing`` strategy, where the caller
    has packed them already (``packing.pack_all``); otherwise they are packed here.
    """
    from tqdm import tqdm

    from probes.batching import rebalance

    n = data.lengths.size
    sizes = sweep_bucket_sizes_for(n, micro_batch_size, grad_accum, bucket_sizes)
    bins = {
        name: rows.bin_of()
        for name, rows in pack_all(data.lengths, max_seq_len, packing, packed).items()
    }
    with_rebalance = batch_rebalance and rebalance.skip_reason(n, grad_accum) is None
    shape = _Shape(micro_batch_size, grad_accum, max_seq_len)
    rows: list[dict[str, Any]] = []
    total = len(seeds) * (len(sizes) + len(bins) + int(with_rebalance))
    with tqdm(total=total, desc="bucket sweep", disable=not progress) as bar:
        for seed in seeds:
            for row in _padded_rows(data, shape, int(seed), sizes, order_fn):
                rows.append(row)
                bar.update()
            for name, bin_of in bins.items():
                rows.append(_packed_row(data, shape, int(seed), name, bin_of))
                bar.update()
            if with_rebalance:
                rows.append(_rebalance_row(data, shape, int(seed)))
                bar.update()
    return _add_relative_to_random(_finish(pd.DataFrame(rows), data, shape))


@dataclass(frozen=True)
class _Shape:
    micro_batch_size: int
    grad_accum: int
    max_seq_len: int


def _padded_rows(
    data: LengthSet, shape: _Shape, seed: int, sizes: Sequence[int], order_fn: OrderFn
) -> Iterator[dict[str, Any]]:
    """Length grouping at every bucket size (1 = random, all = global sort) for one seed."""
    lengths, sources = data.lengths, data.sources
    n, micro = lengths.size, shape.micro_batch_size
    m_all = all_bucket_size(n, micro)
    m_hf = min(hf_trainer_mega_batch_mult(n, micro, shape.grad_accum), m_all)
    perm = seeded_permutation(n, seed)
    for m in sizes:
        order = order_fn(lengths, perm, micro, m)
        metrics = padded_metrics(
            lengths[order], sources[order], micro, shape.grad_accum, data.n_sources
        )
        yield {
            "strategy": _strategy_name(m, m_all),
            "bucket_size_batches": m,
            "bucket_size_examples": min(m * micro, n),
            "is_hf_trainer_default": m == m_hf,
            "seed": seed,
            **metrics,
        }


def _packed_row(
    data: LengthSet, shape: _Shape, seed: int, name: str, bin_of: np.ndarray
) -> dict[str, Any]:
    """One packing strategy's rows, shuffled by the seed, micro_batch_size rows per micro-batch."""
    n_bins = int(bin_of.max()) + 1
    metrics = packed_metrics(
        data.lengths,
        data.sources,
        bin_of,
        seeded_permutation(n_bins, seed),
        shape.micro_batch_size,
        shape.grad_accum,
        shape.max_seq_len,
        data.n_sources,
    )
    return {
        "strategy": f"packing_{name}",
        "bucket_size_batches": None,
        "bucket_size_examples": None,
        "is_hf_trainer_default": False,
        "seed": seed,
        "n_bins": n_bins,
        **metrics,
    }


def _rebalance_row(data: LengthSet, shape: _Shape, seed: int) -> dict[str, Any]:
    """transformers' BatchRebalanceSampler on the seed's shuffle (a comparison row)."""
    from probes.batching import rebalance

    metrics = rebalance.rebalance_metrics(data, shape.micro_batch_size, shape.grad_accum, seed)
    metrics.pop("examples_fed")
    return {
        "strategy": BATCH_REBALANCE,
        "bucket_size_batches": None,
        "bucket_size_examples": None,
        "is_hf_trainer_default": False,
        "seed": seed,
        **metrics,
    }


def _finish(frame: pd.DataFrame, data: LengthSet, shape: _Shape) -> pd.DataFrame:
    """Nullable integer columns, the run's constants and both efficiencies."""
    lengths = data.lengths
    real_tokens = int(lengths.sum())
    attention_useful = int((lengths * lengths).sum())
    frame["bucket_size_batches"] = frame["bucket_size_batches"].astype("Int64")
    frame["bucket_size_examples"] = frame["bucket_size_examples"].astype("Int64")
    if "n_bins" not in frame:
        frame["n_bins"] = None
    frame["n_bins"] = frame["n_bins"].astype("Int64")
    frame.insert(5, "n_examples", lengths.size)
    frame.insert(6, "micro_batch_size", shape.micro_batch_size)
    frame.insert(7, "grad_accum", shape.grad_accum)
    frame["real_tokens"] = real_tokens
    frame["token_efficiency"] = real_tokens / frame["padded_tokens"]
    frame["attention_useful"] = attention_useful
    frame["attention_efficiency"] = attention_useful / frame["attention_cost"]
    return frame


def _add_relative_to_random(frame: pd.DataFrame) -> pd.DataFrame:
    """Gains and diversity relative to random batching with the same seed (paired comparison)."""
    random = frame.loc[frame["strategy"] == "random"].set_index("seed")
    by_seed = frame["seed"]
    padded_random = by_seed.map(random["padded_tokens"])
    attention_random = by_seed.map(random["attention_cost"])
    frame["padded_tokens_saved_vs_random"] = 1.0 - frame["padded_tokens"] / padded_random
    frame["attention_cost_saved_vs_random"] = 1.0 - frame["attention_cost"] / attention_random
    frame["token_speedup_vs_random"] = padded_random / frame["padded_tokens"]
    frame["attention_speedup_vs_random"] = attention_random / frame["attention_cost"]
    for column in RELATIVE_COLUMNS:
        base = by_seed.map(random[column]).to_numpy(dtype=np.float64)
        value = frame[column].to_numpy(dtype=np.float64)
        # Nothing to lose when random batches already have no diversity (one source): 1.0.
        frame[f"{column}_rel_random"] = np.where(base > 0, value / np.where(base > 0, base, 1), 1.0)
    return frame


def strategy_rank(strategy: str) -> int:
    """Random first (the baseline), the sweep, global sort, then packing and anything else."""
    for rank, prefix in enumerate(STRATEGY_ORDER):
        if str(strategy).startswith(prefix):
            return rank
    return len(STRATEGY_ORDER)


def summarise(sweep: pd.DataFrame, diversity_level: str = "step") -> pd.DataFrame:
    """Mean over seeds per strategy × bucket size (packing rows: per strategy, bucket size NA).

    Adds the spread over seeds of both efficiencies (std, ddof 0), the number of seeds, and
    `diversity_rel_random`: the lower of distinct sources and source entropy relative to random,
    per micro-batch (`diversity_level` "micro_batch") or per optimizer step ("step"), as the
    recommendation judges it. Rows in the report's order: contracts.STRATEGY_ORDER, then bucket
    size. This is `results/bucket/summary.parquet`.
    """
    keys = ["strategy", "bucket_size_batches"]
    numeric = sweep.drop(columns=["seed"]).select_dtypes(include="number").columns.difference(keys)
    table = sweep.assign(bucket_size_batches=sweep["bucket_size_batches"].fillna(-1))
    grouped = table.groupby(keys, sort=False)
    summary = grouped[list(numeric)].mean()
    spread = grouped[["token_efficiency", "attention_efficiency"]].std(ddof=0).fillna(0.0)
    summary["token_efficiency_std"] = spread["token_efficiency"]
    summary["attention_efficiency_std"] = spread["attention_efficiency"]
    summary["n_seeds"] = grouped["seed"].nunique()
    if "is_hf_trainer_default" in table:
        summary["is_hf_trainer_default"] = grouped["is_hf_trainer_default"].any()
    summary = summary.reset_index()
    prefix = "micro" if diversity_level == "micro_batch" else "step"
    diversity = [f"{prefix}_distinct_sources_rel_random", f"{prefix}_source_entropy_rel_random"]
    summary["diversity_rel_random"] = summary[diversity].min(axis=1, skipna=False)
    summary["bucket_size_batches"] = summary["bucket_size_batches"].astype("Int64")
    summary.loc[summary["bucket_size_batches"] < 0, "bucket_size_batches"] = pd.NA
    summary["_rank"] = summary["strategy"].map(strategy_rank)
    summary = summary.sort_values(["_rank", "bucket_size_batches", "strategy"], na_position="last")
    return summary.drop(columns="_rank").reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# Recommendation
# --------------------------------------------------------------------------------------------


def recommend(
    sweep: pd.DataFrame,
    gain_share: float,
    min_diversity_share: float,
    gain_metric: str = "tokens",
    diversity_level: str = "step",
    data_parallel: pd.DataFrame | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    """The smallest bucket size reaching ``gain_share`` of the best gain with diversity kept.

    Gain = share of random batching's padded tokens (or dense attention cost) saved, mean over
    seeds. Diversity = the lower of distinct-sources and source-entropy relative to random, at
    the micro-batch or optimizer-step level. Smaller buckets keep batches closer to random.
    With ``world_size > 1`` and the sweep's ``data_parallel`` table, the gain is the saving of
    the slowest rank's cost per step at that world size (``probes.bucket.data_parallel``), and a
    ``data_parallel`` block says so; at ``world_size == 1`` the result is the single-device one.
    """
    summary = summarise(sweep, diversity_level)
    grouped = summary.loc[summary["bucket_size_batches"].notna()].sort_values("bucket_size_batches")
    gain_column = (
        "padded_tokens_saved_vs_random"
        if gain_metric == "tokens"
        else "attention_cost_saved_vs_random"
    )
    dp_summary = None
    if world_size > 1 and data_parallel is not None:
        from probes.bucket import data_parallel as dp

        dp_summary = dp.summarise_data_parallel(data_parallel)
        grouped, gain_column = _gain_at_world_size(grouped, dp_summary, world_size, gain_metric)
    status, chosen, best = _choose(grouped, gain_column, gain_share, min_diversity_share)
    hf = grouped.loc[grouped["is_hf_trainer_default"]]
    m = int(chosen["bucket_size_batches"])
    micro = int(sweep["micro_batch_size"].iloc[0])
    n = int(sweep["n_examples"].iloc[0])
    return {
        "status": status,
        "thresholds": {
            "gain_share": gain_share,
            "min_diversity_share": min_diversity_share,
            "gain_metric": gain_metric,
            "diversity_level": diversity_level,
        },
        "recommended": {
            **_point(chosen, gain_column),
            "bucket_size_examples": min(m * micro, n),
            "how_to_use": (
                f"probes.sampler.LengthGroupedSampler(lengths, micro_batch_size={micro}, "
                f"bucket_size_batches={m}, seed=...) (the ordering measured here; = "
                "transformers.trainer_pt_utils.get_length_grouped_indices(lengths, "
                f"batch_size={micro}, mega_batch_mult={m}))"
            ),
            "hf_trainer_equivalent": _trainer_equivalent(m, int(sweep["grad_accum"].iloc[0])),
        },
        "best_gain": {**_point(best, gain_column)},
        "random": _point(grouped.iloc[0], gain_column),
        "hf_trainer_default": _point(hf.iloc[0], gain_column) if not hf.empty else None,
        "packing": _packing_points(summary),
        "batch_rebalance": _rebalance_point(summary),
        **(
            {}
            if dp_summary is None
            else {"data_parallel": _data_parallel_block(dp_summary, world_size, gain_metric, m)}
        ),
        "attention_note": ATTENTION_NOTE,
        "batch_shapes": _batch_shapes(sweep, m, micro),
    }


def _gain_at_world_size(
    grouped: pd.DataFrame, dp_summary: pd.DataFrame, world_size: int, gain_metric: str
) -> tuple[pd.DataFrame, str]:
    """The grouped summary with the slowest rank's saving at ``world_size``, and its column."""
    from probes.bucket import data_parallel as dp

    at_w = dp_summary.loc[dp_summary["world_size"] == world_size]
    gain_column = dp.gain_column(gain_metric)
    grouped = grouped.merge(
        at_w[["strategy", "bucket_size_batches", gain_column]],
        on=["strategy", "bucket_size_batches"],
        how="left",
        validate="one_to_one",
    )
    return grouped, gain_column


def _choose(
    grouped: pd.DataFrame, gain_column: str, gain_share: float, min_diversity_share: float
) -> tuple[str, pd.Series, pd.Series]:
    """(status, the chosen bucket size's row, the best gain's row)."""
    best = grouped.loc[grouped[gain_column].idxmax()]
    best_gain = float(best[gain_column])
    meets_gain = grouped[gain_column] >= gain_share * best_gain
    meets_diversity = grouped["diversity_rel_random"] >= min_diversity_share
    if best_gain <= 0:
        return "nothing_to_gain", grouped.iloc[0], best
    if (meets_gain & meets_diversity).any():
        return "ok", grouped.loc[meets_gain & meets_diversity].iloc[0], best
    # No size reaches the gain while keeping diversity: the best gain diversity allows.
    allowed = grouped.loc[meets_diversity]
    return "no_size_meets_both", allowed.loc[allowed[gain_column].idxmax()], best


def _packing_points(summary: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Each packing strategy's mean over seeds, by strategy name."""
    return {
        row["strategy"]: {
            "token_efficiency": float(row["token_efficiency"]),
            "attention_efficiency": float(row["attention_efficiency"]),
            "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
            "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
            "n_bins": int(row["n_bins"]),
            "n_micro_batches": int(row["n_micro_batches"]),
            "micro_distinct_sources_rel_random": float(row["micro_distinct_sources_rel_random"]),
            "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
        }
        for _, row in summary.loc[summary["strategy"].str.startswith("packing_")].iterrows()
    }


def _batch_shapes(sweep: pd.DataFrame, m: int, micro: int) -> dict[str, Any]:
    """Micro-batch shapes under bucket size ``m`` (the profile stage's realistic shapes)."""
    recommended_rows = sweep.loc[sweep["bucket_size_batches"] == m]
    packed = sweep.loc[sweep["strategy"].str.startswith("packing_")]
    return {
        "micro_batch_size": micro,
        "padded_length_p50": int(recommended_rows["batch_len_p50"].median()),
        "padded_length_p90": int(recommended_rows["batch_len_p90"].median()),
        "padded_length_max": int(recommended_rows["batch_len_max"].max()),
        "padded_length_mean": float(recommended_rows["batch_len_mean"].mean()),
        "packed_length": int(packed["batch_len_max"].iloc[0]) if not packed.empty else None,
        "note": "micro-batch shapes (rows × padded length) under the recommended bucket "
        "size, median over seeds of each quantile; for the profile stage's realistic shapes",
    }


def _data_parallel_block(
    dp_summary: pd.DataFrame, world_size: int, gain_metric: str, bucket_size: int
) -> dict[str, Any]:
    """What the recommendation judged at ``world_size`` ranks: per strategy (mean over seeds),
    the straggler overhead and the saving of the slowest rank's cost against random."""
    from probes.bucket import data_parallel as dp

    at_w = dp_summary.loc[dp_summary["world_size"] == world_size]
    gain, straggler = dp.gain_column(gain_metric), dp.straggler_column(gain_metric)
    strategies = {}
    for _, row in at_w.iterrows():
        m = row["bucket_size_batches"]
        if row["strategy"] == "length_grouped" and (pd.isna(m) or int(m) != bucket_size):
            continue
        strategies[str(row["strategy"])] = {
            "bucket_size_batches": None if pd.isna(m) else int(m),
            "straggler_overhead": float(row[straggler]),
            "saved_vs_random": float(row[gain]),
        }
    return {
        "world_size": int(world_size),
        "gain": f"{gain}: 1 - sum over steps of the slowest rank's cost / random's",
        "strategies": strategies,
    }


def _rebalance_point(summary: pd.DataFrame) -> dict[str, Any] | None:
    """Mean over seeds of the batch_rebalance comparison row, or None when it was not run."""
    rows = summary.loc[summary["strategy"] == BATCH_REBALANCE]
    if rows.empty:
        return None
    row = rows.iloc[0]
    return {
        "token_efficiency": float(row["token_efficiency"]),
        "attention_efficiency": float(row["attention_efficiency"]),
        "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
        "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
        "n_micro_batches": float(row["n_micro_batches"]),
        "micro_batch_rows_max": float(row["micro_batch_rows_max"]),
        "micro_batch_padded_tokens_max": float(row["micro_batch_padded_tokens_max"]),
        "diversity_rel_random": float(row["diversity_rel_random"]),
        "micro_distinct_sources_rel_random": float(row["micro_distinct_sources_rel_random"]),
        "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
        "order_length_spearman": float(row["order_length_spearman"]),
        "step_real_tokens_cv": float(row["step_real_tokens_cv"]),
    }


def _trainer_equivalent(m: int, grad_accum: int) -> str:
    setting = (
        'TrainingArguments(train_sampling_strategy="group_by_length") (transformers 5; '
        "group_by_length=True in 4.x)"
    )
    if m % grad_accum == 0:
        return (
            f"{setting} groups with batch = micro × grad_accum; this bucket is "
            f"mega_batch_mult={m // grad_accum} there (the Trainer fixes it at "
            f"min(n // (4 × batch), {HF_MAX_MEGA_BATCH_MULT}); other sizes need "
            "probes.sampler.LengthGroupedSampler)"
        )
    return (
        f"not expressible with {setting}: its megabatch is a multiple of micro × "
        f"grad_accum = {grad_accum} micro-batches; use probes.sampler.LengthGroupedSampler"
    )


def _point(row: pd.Series, gain_column: str) -> dict[str, Any]:
    return {
        "bucket_size_batches": int(row["bucket_size_batches"]),
        "token_efficiency": float(row["token_efficiency"]),
        "attention_efficiency": float(row["attention_efficiency"]),
        "gain": float(row[gain_column]),
        "padded_tokens_saved_vs_random": float(row["padded_tokens_saved_vs_random"]),
        "attention_cost_saved_vs_random": float(row["attention_cost_saved_vs_random"]),
        "token_speedup_vs_random": float(row["token_speedup_vs_random"]),
        "diversity_rel_random": float(row["diversity_rel_random"]),
        "micro_distinct_sources_rel_random": float(row["micro_distinct_sources_rel_random"]),
        "micro_source_entropy_rel_random": float(row["micro_source_entropy_rel_random"]),
        "step_distinct_sources_rel_random": float(row["step_distinct_sources_rel_random"]),
        "step_source_entropy_rel_random": float(row["step_source_entropy_rel_random"]),
        "order_length_spearman": float(row["order_length_spearman"]),
        "step_real_tokens_cv": float(row["step_real_tokens_cv"]),
        "micro_batch_padded_tokens_max": float(row["micro_batch_padded_tokens_max"]),
    }
