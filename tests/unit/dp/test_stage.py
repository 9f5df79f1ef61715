import pandas as pd

from probes.dp import stage


def plans() -> pd.DataFrame:
    rows = []
    for strategy, batches in {
        "random": [[40, 10], [30]],
        "length_grouped": [[40, 30], [10]],
    }.items():
        for index, lengths in enumerate(batches):
            rows.append(
                {
                    "strategy": strategy,
                    "micro_batch_index": index,
                    "layout": "padded",
                    "example_lengths": lengths,
                    "example_loss_tokens": [v // 2 for v in lengths],
                }
            )
    rows.append({"strategy": "packing", "micro_batch_index": 0, "layout": "packed"})
    return pd.DataFrame(rows).sample(frac=1.0, random_state=0)  # order from micro_batch_index


def test_backend_for_picks_nccl_on_cuda_and_gloo_on_cpu_unless_given():
    assert stage.backend_for("auto", "cuda") == "nccl"
    assert stage.backend_for("auto", "cpu") == "gloo"
    assert stage.backend_for("gloo", "cuda") == "gloo"


def test_measured_strategies_are_random_and_length_grouped():
    assert stage.measured_strategies(plans()) == ["random", "length_grouped"]


def test_strategy_units_follow_the_plan_order_and_cap_lengths_and_loss():
    assert stage.strategy_units(plans(), "random", None) == ([40, 10, 30], [20, 5, 15])
    lengths, loss = stage.strategy_units(plans(), "random", 16)
    assert lengths == [16, 10, 16]
    assert loss == [15, 5, 15]  # never more than length - 1


def test_job_strategies_shard_each_strategy_over_the_ranks():
    job, indices, total = stage.job_strategies(
        plans(), ["random"], micro=1, grad_accum=1, world=2, n_steps=5, cap=None
    )
    assert total == {"random": 2} and indices == {"random": [0, 1]}
    # micro-batch i on rank i % 2; the 3 units completed to 4 from the first ones
    assert [m["lengths"] for step in job["random"][0] for m in step] == [[40], [30]]
    assert [m["lengths"] for step in job["random"][1] for m in step] == [[10], [40]]
