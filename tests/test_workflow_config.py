"""The workflow rejects a bad config before any job runs, naming the key or path."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def snakemake(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(cwd), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def write_config(tmp_path: Path, **changes) -> Path:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"training.micro_batch_sise": 2}, "micro_batch_sise"),
        ({"training.max_seq_len": "long"}, "max_seq_len"),
        ({"training.loss_on": "everything"}, "loss_on"),
        ({"model.path": "no/such/model"}, "model.path"),
        ({"data.files": [{"path": "no/such/data.jsonl"}]}, "data.files[0].path"),
    ],
)
def test_bad_config_fails_before_any_job_naming_the_key(tmp_path, changes, expected):
    result = snakemake("-n", "report", "--configfile", str(write_config(tmp_path, **changes)))
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


def test_dry_run_lists_the_chain_in_order():
    result = snakemake("-n", "report", "--forceall", "--quiet", "rules")
    assert result.returncode == 0, result.stderr
    for rule in ("mask", "padding", "bucket_sweep", "profile", "report"):
        assert rule in result.stdout


def test_lint_passes():
    result = snakemake("--lint")
    assert result.returncode == 0, result.stdout + result.stderr
