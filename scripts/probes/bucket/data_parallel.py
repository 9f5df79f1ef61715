"""The bucket sweep's data-parallel view: each strategy's straggler cost at W = 1, 2, 4, 8 ranks.

Every row is one strategy × bucket size × seed × world size of the sweep, sharded over the ranks
as the HF Trainer and accelerate shard it (``probes.batching.ranks``), with the same orders as
the single-device sweep (same seed, same shuffle). Per cost (padded tokens, dense attention):
``Σ_steps max_ranks`` (what the step waits for), ``Σ_steps mean_ranks`` (balanced ranks), the
straggler overhead ``max / mean − 1`` and the saving of the max against random batching at the
same seed and world size. At ``W = 1`` the max is the sweep's own single-device cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from probes.batching import ranks
from probes.batching.orders import (
    OrderFn,
    all_bucket_size,
    length_grouped_order,
    seeded_permutation,
    sweep_bucket_sizes_for,
)
from probes.batching.packing import PACKING_STRATEGIES, PackedRows, pack_all
from probes.contracts import BATCH_REBALANCE, RANDOM
from probes.lengths import LengthSet

KEYS = ("strategy", "bucket_size_batches", "seed", "world_size")


def _strategy_name(m: int, m_all: int) -> str:
    if m == 1:
        return RANDOM
    return "global_sort" if m == m_all else "length_grouped"


def _row(costs: dict[str, np.ndarray], grad_accum: int) -> dict[str, float | int]:
    row: dict[str, float | int] = {}
    for kind in ranks.COST_KINDS:
        cost = ranks.straggler_cost(costs[kind], grad_accum)
        row["n_steps"] = cost["n_steps"]
        row["micro_batches_per_rank"] = cost["micro_batches_per_rank"]
        row[f"{kind}_step_max"] = cost["step_max_sum"]
        row[f"{kind}_step_mean"] = cost["step_mean_sum"]
        row[f"{kind}_straggler"] = cost["straggler_overhead"]
    return row


def data_parallel_sweep(
    data: LengthSet,
    micro_batch_size: int,
    grad_accum: int,
    max_seq_len: int,
    seeds: Sequence[int],
    world_sizes: Iterable[int] = ranks.DP_WORLD_SIZES,
    bucket_sizes: Iterable[int] | None = None,
    packing: Sequence[str] = PACKING_STRATEGIES,
    order_fn: OrderFn = length_grouped_order,
    batch_rebalance: bool = True,
    packed: Mapping[str, PackedRows] | None = None,
) -> pd.DataFrame:
    """One row per strategy × bucket size × seed × world size (TABLES["bucket_data_parallel"])."""
    from probes.batching import rebalance

    lengths = data.lengths
    n = lengths.size
    sizes = sweep_bucket_sizes_for(n, micro_batch_size, grad_accum, bucket_sizes)
    m_all = all_bucket_size(n, micro_batch_size)
    n_rows = {
        name: rows.n_rows for name, rows in pack_all(lengths, max_seq_len, packing, packed).items()
    }
    with_rebalance = batch_rebalance and rebalance.unavailable_reason() is None
    worlds = sorted({ranks.check_world_size(w) for w in world_sizes})
    rows: list[dict] = []
    for seed in seeds:
        perm = seeded_permutation(n, seed)
        units: list[tuple[str, int | None, np.ndarray]] = []
        for m in sizes:
            order = order_fn(lengths, perm, micro_batch_size, m)
            units.append((_strategy_name(m, m_all), m, lengths[order]))
        for name, n_bins in n_rows.items():
            units.append((f"packing_{name}", None, np.full(n_bins, max_seq_len, dtype=np.int64)))
        for world in worlds:
            for strategy, m, unit_lengths in units:
                costs = ranks.padded_costs(unit_lengths, micro_batch_size, world)
                rows.append(
                    {
                        "strategy": strategy,
                        "bucket_size_batches": m,
                        "seed": int(seed),
                        "world_size": world,
                        **_row(costs, grad_accum),
                    }
                )
            if with_rebalance:
                costs = ranks.rebalance_costs(lengths, micro_batch_size, grad_accum, world, seed)
                rows.append(
                    {
                        "strategy": BATCH_REBALANCE,
                        "bucket_size_batches": None,
                        "seed": int(seed),
                        "world_size": world,
                        **_row(costs, grad_accum),
                    }
                )
    frame = pd.DataFrame(rows)
    frame["bucket_size_batches"] = frame["bucket_size_batches"].astype("Int64")
    return _add_saving_vs_random(frame)


def _add_saving_vs_random(frame: pd.DataFrame) -> pd.DataFrame:
    """1 − max-over-ranks cost / random's, same seed and world size (paired)."""
    random = frame.loc[frame["strategy"] == RANDOM].set_index(["seed", "world_size"])
    index = pd.MultiIndex.from_frame(frame[["seed", "world_size"]])
    for kind in ranks.COST_KINDS:
        base = random[f"{kind}_step_max"].reindex(index).to_numpy(dtype=np.float64)
        frame[f"dp_{kind}_saved_vs_random"] = 1.0 - frame[f"{kind}_step_max"] / base
    return frame


def summarise_data_parallel(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per strategy × bucket size × world size."""
    keys = ["strategy", "bucket_size_batches", "world_size"]
    table = frame.assign(bucket_size_batches=frame["bucket_size_batches"].fillna(-1))
    numeric = [c for c in table.columns if c not in (*keys, "seed")]
    summary = table.groupby(keys, sort=False)[numeric].mean().reset_index()
    summary["bucket_size_batches"] = summary["bucket_size_batches"].astype("Int64")
    summary.loc[summary["bucket_size_batches"] < 0, "bucket_size_batches"] = pd.NA
    return summary


def gain_column(gain_metric: str) -> str:
    kind = "padded_tokens" if gain_metric == "tokens" else "attention_cost"
    return f"dp_{kind}_saved_vs_random"


def straggler_column(gain_metric: str) -> str:
    kind = "padded_tokens" if gain_metric == "tokens" else "attention_cost"
    return f"{kind}_straggler"
