"""`snakemake profile` end to end on a tiny model (slow: starts Snakemake)."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import REPO


@pytest.mark.slow
def test_snakemake_profile_rule_runs_on_cpu(tmp_path, tiny_model_dir):
    (tmp_path / "results/padding").mkdir(parents=True)
    (tmp_path / "results/bucket").mkdir(parents=True)
    pd.DataFrame(
        {
            "example_id": [f"{i:016x}" for i in range(20)],
            "source": "s",
            "status": "OK",
            "n_tokens": [6 + i for i in range(20)],
            "n_loss_tokens": [3] * 20,
        }
    ).to_parquet(tmp_path / "results/padding/lengths.parquet")
    (tmp_path / "results/bucket/recommendation.json").write_text('{"bucket_size": 8}')
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"files": [{"path": str(data)}]},
        "training": {"micro_batch_size": 2},
        "profile": {
            "device": "cpu",
            "cpu": {"lengths": [8, 16, 24], "warmup": 0, "repeats": 1},
            "padding_draws": 8,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [
        sys.executable, "-m", "snakemake",
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path),
        "--configfile", str(tmp_path / "config.yaml"),
        "--cores", "1",
        "profile",
        "--allowed-rules", "profile",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "results/profile"
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["cpu_only"] is True
    assert provenance["bucket_recommendation"] == {"bucket_size": 8}
    assert json.loads((out / "control.json").read_text())["passed"] is True
    assert len(pd.read_parquet(out / "scaling.parquet")) == 3
