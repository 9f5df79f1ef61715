"""The data_parallel rule with world_size 2 on CPU: two gloo ranks under torchrun, each loading
the tiny model through the reference harness and running its shard of the bucket stage's plans;
with a trainer factory, each rank builds the user's SFTTrainer and runs it under DDP and under
its own FSDP2 (fsdp_config), its micro-batches from its own distributed dataloader.
At world_size 1 (the default) the rule is not in the DAG; a rank that dies is one message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainer_factories import write_factory

from conftest import REPO, chat_rows, write_jsonl
from probes.contracts import STAGE_OUTPUTS, check_table_columns
from probes.io import read_json, read_parquet

# the module-scoped fixtures are built once: every test of the module on one worker
pytestmark = pytest.mark.xdist_group("data_parallel")
# small: two sampled steps per strategy, one measured round after one warm-up round
DP_CONFIG = {"steps": 2, "rounds": 1, "warmup_rounds": 1, "cpu": {"max_seq_len": 32}}
# rank 1 dies at its first loss; rank 0 would wait for it at the first collective
DYING_HARNESS = """
import os
from probes.reference_harness import *  # noqa: F403
from probes.reference_harness import compute_loss as _loss

def compute_loss(model, batch):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one ran out of luck")
    return _loss(model, batch)
"""


def snakemake(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    # targets first: --configfile takes every value after it
    command = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--snakefile"]
    command += [str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def tiny(workdir: Path, model_dir: Path, world_size: int) -> dict:
    data = write_jsonl(workdir / "chat.jsonl", chat_rows(24))
    return {
        "model": {"path": str(model_dir)},
        "data": {"files": [{"path": str(data)}]},
        "training": {
            "micro_batch_size": 2,
            "grad_accum": 2,
            "max_seq_len": 96,
            "world_size": world_size,
        },
        "profile": {"device": "cpu"},
        "data_parallel": DP_CONFIG,
    }


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_model_dir) -> tuple[Path, dict]:
    """mask, padding and bucket_sweep once, for the tests that run the stage."""
    workdir = tmp_path_factory.mktemp("dp")
    config = tiny(workdir, tiny_model_dir, 2)
    run = snakemake(workdir, config, "bucket_sweep")
    assert run.returncode == 0, run.stderr[-4000:]
    return workdir, config


def test_world_size_1_leaves_the_rule_out_of_the_dag(tmp_path, tiny_model_dir):
    run = snakemake(tmp_path, tiny(tmp_path, tiny_model_dir, 1), "--dry-run", "report")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rule report:" in run.stdout
    assert "rule data_parallel:" not in run.stdout
    two = snakemake(tmp_path, tiny(tmp_path, tiny_model_dir, 2), "--dry-run", "report")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rule data_parallel:" in two.stdout  # control: the same config at W=2 has it


@pytest.mark.slow  # ~75 s on 2 busy cores: mask, padding, bucket_sweep, then two ranks
def test_data_parallel_rule_runs_two_gloo_ranks(upstream):
    workdir, config = upstream
    run = snakemake(workdir, config, "data_parallel")
    assert run.returncode == 0, run.stderr[-4000:]
    results = workdir / "results"
    steps = read_parquet(results / STAGE_OUTPUTS["data_parallel"]["steps"])
    check_table_columns(steps.columns, "data_parallel_steps", "steps.parquet")
    summary = read_json(results / STAGE_OUTPUTS["data_parallel"]["summary"])
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1]
    assert all(r["threads"] == 1 and r["hostname"] for r in summary["ranks"])
    # the harness is measured under DDP only; FSDP2 (the default's second) needs a trainer
    assert set(summary["runs"]) == {"ddp"} and "fsdp2" in summary["not_measured"]
    assert set(summary["runs"]["ddp"]) == {"random", "length_grouped"}
    # every (strategy, sampled step) measured on both ranks, one round
    n_sampled = sum(len(v) for v in summary["sampled_steps"].values())
    assert len(steps) == n_sampled * 2
    assert (steps["collective_s"] > 0).all() and (steps["single_s"] > 0).all()
    assert (steps["step_s"] >= steps["wait_s"] + steps["collective_s"]).all()
    for values in summary["runs"]["ddp"].values():
        assert 0 < values["communication_share"] < 1
        assert values["predicted_s"] > 0 and values["ratio"] > 0
    # lengths capped on CPU: a step is grad_accum 2 micro-batches of 2 rows of <= 32 tokens
    assert steps["padded_tokens"].max() <= 2 * 2 * 32
    assert (steps["n_micro_batches"] == 2).all()


@pytest.mark.slow
def test_a_rank_that_dies_is_one_message_naming_it_and_nothing_is_written(upstream, tmp_path):
    from probes.config import load_config, stage_inputs
    from probes.dp import stage
    from probes.settings import WorkflowConfig

    workdir, config = upstream
    harness = tmp_path / "dying_harness.py"
    harness.write_text(DYING_HARNESS)
    raw = load_config(workdir / "config.yaml")
    raw["profile"]["harness"] = str(harness)
    inputs = stage_inputs("data_parallel", raw, workdir / "results")
    outputs = {k: str(tmp_path / v) for k, v in STAGE_OUTPUTS["data_parallel"].items()}
    with pytest.raises(stage.DataParallelError) as error:
        stage.run(inputs, outputs, WorkflowConfig.from_dict(raw))
    message = str(error.value)
    assert "rank 1 of 2 failed first" in message
    # the harness's own failure, named as every harness failure is (probes.step.harness)
    assert "profile.harness" in message and "rank one ran out of luck" in message
    assert "No output written" in message
    assert not any(Path(p).exists() for p in outputs.values())
    # the other stages' results are kept
    assert (workdir / "results" / STAGE_OUTPUTS["bucket"]["plans"]).is_file()


@pytest.mark.parametrize("world_size", [64])
def test_a_world_size_the_machine_cannot_host_fails_with_one_message(tmp_path, world_size):
    from probes.config import load_config
    from probes.dp import stage
    from probes.settings import WorkflowConfig

    raw = load_config()
    raw["training"]["world_size"] = world_size
    raw["profile"]["device"] = "cpu"
    outputs = {k: str(tmp_path / v) for k, v in STAGE_OUTPUTS["data_parallel"].items()}
    with pytest.raises(stage.ProbeError, match=f"world_size={world_size}.*CPU cores"):
        stage.run({}, outputs, WorkflowConfig.from_dict(raw))
    assert not any(Path(p).exists() for p in outputs.values())


# the user's command, unmodified (trainer.command): it builds the trainer and calls train(); on
# rank 1 the trainer's loss raises, and rank 0 would wait for it at the first collective
DYING_COMMAND = """
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("base_factory", {base!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

trainer = _base.build_trainer({{}})
if os.environ.get("RANK") == "1":
    def compute_loss(*args, **kwargs):
        raise RuntimeError("rank one ran out of luck")

    trainer.compute_loss = compute_loss
trainer.train()
"""


def trainer_stage(upstream, tmp_path, trainer: dict, sharding: list[str]):
    """stage.run on the upstream plans with `trainer` as the trainer section (a factory or a
    command): the trainer path reads the plans' strategies and the recommended bucket size."""
    from probes.config import load_config, stage_inputs
    from probes.settings import WorkflowConfig

    workdir, _ = upstream
    raw = load_config(workdir / "config.yaml")
    raw["trainer"].update(trainer)
    raw["data_parallel"]["sharding"] = sharding
    inputs = stage_inputs("data_parallel", raw, workdir / "results")
    outputs = {k: str(tmp_path / v) for k, v in STAGE_OUTPUTS["data_parallel"].items()}
    return inputs, outputs, WorkflowConfig.from_dict(raw)


@pytest.mark.slow  # ~35 s: two torchrun launches of two ranks each building the SFTTrainer
def test_the_trainer_runs_under_ddp_and_fsdp2_with_its_own_distributed_batches(
    upstream, tmp_path, tiny_model_dir
):
    from probes.dp import stage

    workdir, config = upstream
    data = Path(config["data"]["files"][0]["path"])
    factory = write_factory(tmp_path, tiny_model_dir, data, max_length=96)
    inputs, outputs, cfg = trainer_stage(upstream, tmp_path, {"factory": factory}, ["ddp", "fsdp2"])
    stage.run(inputs, outputs, cfg)
    steps = read_parquet(outputs["steps"])
    check_table_columns(steps.columns, "data_parallel_steps", "steps.parquet")
    summary = read_json(outputs["summary"])
    assert summary["timed_step"]["kind"] == "trainer"
    assert summary["timed_step"]["trainer"] == "SFTTrainer"
    assert set(summary["runs"]) == {"ddp", "fsdp2"}
    wrapped = {s: {r["wrapper"] for r in ranks} for s, ranks in summary["wrapped"].items()}
    assert wrapped["ddp"] == {"DistributedDataParallel"}
    assert all(name.startswith("FSDP") for name in wrapped["fsdp2"]), wrapped
    assert all(r["fsdp"]["fsdp_version"] == 2 for r in summary["wrapped"]["fsdp2"])
    for sharding, run in summary["runs"].items():
        assert set(run) == {"random", "length_grouped"}, sharding
        rows = steps[steps["sharding"] == sharding]
        assert sorted(set(rows["rank"])) == [0, 1]
        assert (rows["step_s"] > 0).all() and (rows["single_s"] > 0).all()
        assert (rows["wait_s"] >= 0).all() and (rows["collective_s"] >= 0).all()
        for values in run.values():
            assert values["predicted_s"] > 0 and values["ratio"] > 0
    # the trainer's own batches, cut to data_parallel.cpu.max_seq_len on CPU: 2 micro-batches
    # of 2 rows a step; the ranks got different rows (its distributed sampler's shards)
    assert steps["padded_tokens"].max() <= 2 * 2 * 32 and (steps["n_micro_batches"] == 2).all()
    ddp = steps[steps["sharding"] == "ddp"].pivot_table(
        index=["strategy", "step", "round"], columns="rank", values="real_tokens"
    )
    assert (ddp[0] != ddp[1]).any()


@pytest.mark.slow  # ~15 s: the command's trainer built on both ranks, rank 1 dies at its loss
def test_a_trainer_command_rank_that_dies_is_one_message_naming_it(
    upstream, tmp_path, tiny_model_dir
):
    from probes.dp import stage

    workdir, config = upstream
    data = Path(config["data"]["files"][0]["path"])
    base = write_factory(tmp_path, tiny_model_dir, data, max_length=96).rpartition(":")[0]
    script = tmp_path / "train.py"
    script.write_text(DYING_COMMAND.format(base=base))
    command = {"command": ["python", str(script)]}
    inputs, outputs, cfg = trainer_stage(upstream, tmp_path, command, ["ddp"])
    with pytest.raises(stage.DataParallelError) as error:
        stage.run(inputs, outputs, cfg)
    message = str(error.value)
    assert "rank 1 of 2 failed first" in message and "rank one ran out of luck" in message
    assert "trainer.command" in message and "training_step" in message
    assert not any(Path(p).exists() for p in outputs.values())
