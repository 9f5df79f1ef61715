import numpy as np

from probes.batching import ranks
from probes.dp import shard


def test_rank_plans_round_robin_micro_batches_then_grad_accum_per_step():
    # 8 units, micro 1, grad_accum 2, W 2: micro-batch i on rank i % 2; steps of 2 local ones
    plan = shard.rank_plans(8, micro=1, grad_accum=2, world=2)
    assert plan[0] == [[[0], [2]], [[4], [6]]]
    assert plan[1] == [[[1], [3]], [[5], [7]]]


def test_rank_plans_completes_the_last_round_as_accelerate_even_batches():
    # 5 units, micro 2: 3 micro-batches -> 4 at W=2, the tail filled from the first units
    plan = shard.rank_plans(5, micro=2, grad_accum=1, world=2)
    fed = ranks.even_batches_order(np.arange(5), 2, 2).tolist()
    assert fed == [0, 1, 2, 3, 4, 0, 1, 2]
    assert plan[0] == [[[0, 1]], [[4, 0]]]
    assert plan[1] == [[[2, 3]], [[1, 2]]]
    assert shard.common_steps(plan) == 2


def test_rank_plans_at_world_size_1_is_the_single_process_order():
    plan = shard.rank_plans(5, micro=2, grad_accum=2, world=1)
    assert plan == [[[[0, 1], [2, 3]], [[4]]]]


def test_map_plan_replaces_indices_by_values():
    plan = shard.rank_plans(4, micro=2, grad_accum=1, world=2)
    assert shard.map_plan(plan, [10, 20, 30, 40]) == [[[[10, 20]]], [[[30, 40]]]]


def test_sample_steps_spreads_over_the_epoch_first_and_last_included():
    assert shard.sample_steps(10, 4) == [0, 3, 6, 9]
    assert shard.sample_steps(3, 5) == [0, 1, 2]
    assert shard.sample_steps(0, 2) == []
