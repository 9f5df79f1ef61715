import json

import pandas as pd
import pytest

from conftest import workflow_config
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


def test_the_launch_comes_from_the_typed_sections_and_refuses_world_size_1():
    cfg = workflow_config(
        training={"world_size": 2, "micro_batch_size": 2},
        profile={"device": "cpu", "dtype": "float32", "harness_options": {"lora_r": 4}},
        data_parallel={"backend": "gloo", "cpu": {"max_seq_len": 64, "threads_per_rank": 1}},
    )
    setup = stage.resolve_launch(cfg)
    assert (setup.world, setup.device_type, setup.backend, setup.dtype) == (
        2,
        "cpu",
        "gloo",
        "float32",
    )
    assert setup.cpu_only and setup.cap == 64 and setup.threads == 1 and setup.timed_step is None
    job = stage.worker_job("out", "model", cfg, setup, {"random": []}, {"random": [0]})
    assert json.loads(json.dumps(job))["profile"] == {
        "harness": cfg.profile.harness,
        "harness_options": {"lora_r": 4},
        "attn_implementation": cfg.profile.attn_implementation,
        "ce_chunk_tokens": cfg.profile.ce_chunk_tokens,
    }
    assert job["seed"] == cfg.data_parallel.seed and job["rounds"] == cfg.data_parallel.rounds
    with pytest.raises(stage.DataParallelError, match="world_size is 1"):
        stage.resolve_launch(workflow_config(training={"world_size": 1}))


def test_a_trainer_factory_is_said_to_be_timed_through_the_harness():
    assert stage.timed_step_note(None, "probes.reference_harness") is None
    note = stage.timed_step_note("train.py:build", "probes.reference_harness")
    assert "train.py:build" in note and "probes.reference_harness" in note
