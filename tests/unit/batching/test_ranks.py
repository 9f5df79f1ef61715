"""Data-parallel plans: accelerate's sharding reproduced, the straggler cost in closed form."""

import itertools
from fractions import Fraction

import numpy as np
import pytest

from probes import lengths as lengths_module
from probes.batching import metrics, orders, ranks
from probes.batching.rebalance import rebalance_sampler_class
from probes.bucket import data_parallel as dp
from probes.bucket import sweep as bucket


def _accelerate_shards(n: int, micro: int, world: int) -> list[list[list[int]]]:
    """What accelerate's own BatchSamplerShard yields on each rank for a sequential sampler."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(n)), batch_size=micro, drop_last=False)
    return [
        [list(b) for b in BatchSamplerShard(batches, world, rank, even_batches=True)]
        for rank in range(world)
    ]


@pytest.mark.parametrize(
    ("n", "micro", "world"),
    [(10, 2, 2), (11, 2, 2), (7, 3, 4), (3, 2, 4), (17, 2, 8), (16, 2, 4), (5, 1, 3), (1, 4, 2)],
)
def test_even_batches_order_is_accelerates_batch_sampler_shard(n, micro, world):
    pytest.importorskip("accelerate")
    theirs = _accelerate_shards(n, micro, world)
    fed = ranks.even_batches_order(np.arange(n), micro, world)
    ours = [fed[i * micro : (i + 1) * micro].tolist() for i in range(fed.size // micro)]
    rank = ranks.rank_of_micro_batch(len(ours), world)
    for r in range(world):
        assert [b for b, owner in zip(ours, rank, strict=True) if owner == r] == theirs[r]


def test_world_size_one_is_the_single_device_sweep():
    values = np.random.default_rng(0).integers(1, 300, 101)
    order = orders.length_grouped_order(values, orders.seeded_permutation(101, 0), 2, 4)
    costs = ranks.padded_costs(values[order], 2, 1)
    assert costs["padded_tokens"].sum() == metrics.batch_slots(values[order], 2)
    assert costs["attention_cost"].sum() == metrics.batch_slots(values[order], 2, power=2)
    cost = ranks.straggler_cost(costs["padded_tokens"], 4)
    assert cost["step_max_sum"] == cost["step_mean_sum"] and cost["straggler_overhead"] == 0.0


@pytest.mark.parametrize("world", [2, 3])
def test_random_straggler_cost_equals_the_order_statistics_closed_form(world):
    """Micro-batch 1, no accumulation: each step runs `world` distinct examples, one per rank, so
    over all n! orders E[Σ_steps max] = (n / W) · E[max of W draws without replacement], and the
    mean over ranks is Σ lengths / W for every order. Brute force over every permutation."""
    values = np.array([1, 2, 3, 5, 8, 13], dtype=np.int64)
    total_max, n_orders = 0, 0
    for perm in itertools.permutations(range(values.size)):
        costs = ranks.padded_costs(values[list(perm)], 1, world)["padded_tokens"]
        cost = ranks.straggler_cost(costs, 1)
        assert cost["step_mean_sum"] == pytest.approx(values.sum() / world)
        total_max += cost["step_max_sum"]
        n_orders += 1
    ordered = sorted(values.tolist())
    n = len(ordered)
    closed_form = Fraction(n, world) * Fraction(
        sum(v * _comb(i, world - 1) for i, v in enumerate(ordered)), _comb(n, world)
    )
    assert Fraction(total_max, n_orders) == closed_form
    assert ranks.expected_max_of_uniform_choice(values, world) * n / world == pytest.approx(
        float(closed_form)
    )


def _comb(n: int, k: int) -> int:
    from math import comb

    return comb(n, k)


def test_one_long_example_costs_exactly_one_long_step_under_hf_random():
    """HF's random order moves the longest example into micro-batch 0: with one long example
    among short ones, step 0 costs the long one and every other step a short one, any seed."""
    values = np.array([9] + [2] * 15, dtype=np.int64)
    for seed in range(4):
        order = orders.length_grouped_order(values, orders.seeded_permutation(16, seed), 1, 1)
        costs = ranks.padded_costs(values[order], 1, 4)["padded_tokens"]
        cost = ranks.straggler_cost(costs, 2)
        assert cost["n_steps"] == 2
        assert cost["step_max_sum"] == (9 + 2) + (2 + 2)


@pytest.mark.skipif(rebalance_sampler_class() is None, reason="transformers < 5")
def test_rebalance_ranks_partition_each_global_batch():
    values = np.random.default_rng(1).integers(1, 500, 64)
    per_rank = ranks.rebalance_rank_batches(values, 2, 2, 4, seed=0)
    assert len({len(b) for b in per_rank}) == 1  # same number of micro-batches per rank
    fed = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert fed == list(range(64))  # 64 = 2 global batches of 2 x 2 x 4: every example once


def test_data_parallel_sweep_at_w1_matches_the_sweep_and_recommendation_unchanged():
    rng = np.random.default_rng(2)
    data = lengths_module.LengthSet(
        rng.integers(1, 1024, 600).astype(np.int64), np.zeros(600, np.int32), ("none",)
    )
    args = {"micro_batch_size": 2, "grad_accum": 4, "max_seq_len": 1024, "seeds": [0, 1]}
    sweep = bucket.sweep_bucket_sizes(data, **args, batch_rebalance=False)
    table = dp.data_parallel_sweep(data, **args, world_sizes=[1, 2, 8], batch_rebalance=False)
    at_1 = table.loc[table["world_size"] == 1].reset_index(drop=True)
    assert at_1["padded_tokens_step_max"].tolist() == sweep["padded_tokens"].tolist()
    assert at_1["attention_cost_step_max"].tolist() == sweep["attention_cost"].tolist()
    at_8 = table.loc[table["world_size"] == 8]
    random_8 = at_8.loc[at_8["strategy"] == "random", "padded_tokens_straggler"]
    assert (random_8 > 0).all()  # random's slowest rank costs more than the mean
    single = bucket.recommend(sweep, 0.9, 0.8)
    assert bucket.recommend(sweep, 0.9, 0.8, data_parallel=table, world_size=1) == single
    at_w = bucket.recommend(sweep, 0.9, 0.8, data_parallel=table, world_size=8)
    assert at_w["data_parallel"]["world_size"] == 8
    assert "data_parallel" not in single


def test_world_size_below_one_is_refused():
    with pytest.raises(ranks.WorldSizeError, match="training.world_size=0"):
        ranks.check_world_size(0)
