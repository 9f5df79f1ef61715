"""The data_parallel rule with world_size 2 on CPU: two gloo ranks under torchrun, each loading
the tiny model through the reference harness and running its shard of the bucket stage's plans.
At world_size 1 (the default) the rule is not in the DAG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, chat_rows, write_jsonl
from probes.contracts import STAGE_OUTPUTS, check_table_columns
from probes.io import read_json, read_parquet

# small: two sampled steps per strategy, one measured round after one warm-up round
DP_CONFIG = {"steps": 2, "rounds": 1, "warmup_rounds": 1, "cpu": {"max_seq_len": 32}}


def snakemake(tmp_path: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    # targets first: --configfile takes every value after it
    command = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--snakefile"]
    command += [str(REPO / "Snakefile"), "--directory", str(tmp_path), "--configfile", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def tiny(tmp_path: Path, model_dir: Path, world_size: int) -> dict:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
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


def test_world_size_1_leaves_the_rule_out_of_the_dag(tmp_path, tiny_model_dir):
    run = snakemake(tmp_path, tiny(tmp_path, tiny_model_dir, 1), "--dry-run", "report")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rule report:" in run.stdout
    assert "rule data_parallel:" not in run.stdout
    two = snakemake(tmp_path, tiny(tmp_path, tiny_model_dir, 2), "--dry-run", "report")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rule data_parallel:" in two.stdout  # control: the same config at W=2 has it


@pytest.mark.slow  # ~75 s on 2 busy cores: mask, padding, bucket_sweep, then two ranks
def test_data_parallel_rule_runs_two_gloo_ranks(tmp_path, tiny_model_dir):
    run = snakemake(tmp_path, tiny(tmp_path, tiny_model_dir, 2), "data_parallel")
    assert run.returncode == 0, run.stderr[-4000:]
    results = tmp_path / "results"
    steps = read_parquet(results / STAGE_OUTPUTS["data_parallel"]["steps"])
    check_table_columns(steps.columns, "data_parallel_steps", "steps.parquet")
    summary = read_json(results / STAGE_OUTPUTS["data_parallel"]["summary"])
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1]
    assert all(r["threads"] == 1 and r["hostname"] for r in summary["ranks"])
    assert set(summary["strategies"]) == {"random", "length_grouped"}
    # every (strategy, sampled step) measured on both ranks, one round
    n_sampled = sum(len(v) for v in summary["sampled_steps"].values())
    assert len(steps) == n_sampled * 2
    assert (steps["collective_s"] > 0).all() and (steps["single_s"] > 0).all()
    assert (steps["step_s"] >= steps["wait_s"] + steps["collective_s"]).all()
    for values in summary["strategies"].values():
        assert 0 < values["communication_share"] < 1
        assert values["predicted_s"] > 0 and values["ratio"] > 0
    # lengths capped on CPU: a step is grad_accum 2 micro-batches of 2 rows of <= 32 tokens
    assert steps["padded_tokens"].max() <= 2 * 2 * 32
    assert (steps["n_micro_batches"] == 2).all()


@pytest.mark.parametrize("world_size", [64])
def test_a_world_size_the_machine_cannot_host_fails_with_one_message(
    tmp_path, tiny_model_dir, world_size
):
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
