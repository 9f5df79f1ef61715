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
    assert setup.cpu_only and setup.cap == 64 and setup.threads == 1 and setup.trainer is None
    # the harness is measured under DDP; FSDP2 (the default's second) needs the trainer
    assert setup.shardings == ("ddp",) and "trainer.factory" in setup.not_measured["fsdp2"]
    job = stage.worker_job("out", "model", cfg, setup)
    assert json.loads(json.dumps(job))["profile"] == {
        "harness": cfg.profile.harness,
        "harness_options": {"lora_r": 4},
        "attn_implementation": cfg.profile.attn_implementation,
        "ce_chunk_tokens": cfg.profile.ce_chunk_tokens,
    }
    assert job["seed"] == cfg.data_parallel.seed and job["rounds"] == cfg.data_parallel.rounds
    with pytest.raises(stage.DataParallelError, match="world_size is 1"):
        stage.resolve_launch(workflow_config(training={"world_size": 1}))


def test_a_trainer_runs_every_sharding_asked_for_and_a_bad_sharding_is_refused():
    assert stage.shardings_for(("ddp", "fsdp2"), "train.py:build") == (["ddp", "fsdp2"], {})
    assert stage.shardings_for(("fsdp2",), "train.py:build") == (["fsdp2"], {})
    with pytest.raises(stage.DataParallelError, match=r"data_parallel.sharding \['zero3'\]"):
        stage.shardings_for(("zero3",), None)


def test_the_trainer_job_carries_the_trainer_section_and_the_fsdp_config():
    cfg = workflow_config(
        training={"world_size": 2},
        profile={"device": "cpu", "dtype": "float32"},
        trainer={"factory": "train.py:build"},
    )
    setup = stage.resolve_launch(cfg)
    assert setup.trainer == "train.py:build" and setup.shardings == ("ddp", "fsdp2")
    job = stage.trainer_plans(["random"], 4, cfg, setup, "fsdp2")["trainer"]
    assert job["section"]["factory"] == "train.py:build"
    assert job["fsdp_config"] == {"version": 2, "reshard_after_forward": True}
    assert job["bucket_size_batches"] == 4 and job["cap"] == setup.cap
    assert stage.trainer_plans(["random"], 4, cfg, setup, "ddp")["trainer"]["fsdp_config"] is None


def test_the_ranks_progress_streams_through_and_its_tail_is_kept(capfd):
    """rank 0's progress bar (tqdm: segments ended by carriage returns) reaches the stage's
    stderr as it comes; anything else the user's trainer writes there (a warning quoting an
    example) is not echoed, only kept in the tail for the failure message; a run past the
    timeout is stopped."""
    import subprocess
    import sys

    code = (
        "import sys; w = sys.stderr.write; w('a user warning quoting an example\\n');"
        " w('\\rdata_parallel ddp, rank 0 of 2:  50%'); w('\\rdata_parallel ddp, rank 0 of 2:"
        " 100%\\n'); w('x' * 5000 + 'the end'); sys.exit(3)"
    )
    returncode, tail = stage.run_streaming([sys.executable, "-c", code], {}, 60, keep=100)
    assert returncode == 3 and tail.endswith("the end") and len(tail) == 100
    err = capfd.readouterr().err
    assert "data_parallel ddp, rank 0 of 2:  50%" in err and "100%" in err
    assert "quoting an example" not in err and "the end" not in err
    with pytest.raises(subprocess.TimeoutExpired):
        stage.run_streaming([sys.executable, "-c", "import time; time.sleep(30)"], {}, 0.5)
