"""The workflow rejects a bad config before any job runs, naming the key or path; the default
config and CI's `.test/` config lint clean and dry-run."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_workflow

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
TEST_CONFIG = Path(".test") / "config" / "config.yaml"  # relative to the workflow directory
# `--configfile` takes several files: it goes after the target, or it swallows the target.
CONFIGS = {"default": [], "test-config": ["--configfile", str(TEST_CONFIG)]}


def snakemake(
    *args: str, cwd: Path = REPO, snakefile: Path = REPO / "Snakefile"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, "--snakefile", str(snakefile), "--directory", str(cwd), *args],
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
        # dropped with the project's own packer: the message says why and what to use
        ({"bucket.packing": ["ffd", "bfd"]}, "bucket.packing.0: packing strategy 'ffd'"),
        ({"trainer.factory": "no/such/train.py:build_trainer"}, "config key trainer.factory"),
        ({"trainer.factory": "examples/sft_trainer.py"}, "a module, a colon"),
    ],
)
def test_bad_config_fails_before_any_job_naming_the_key(tmp_path, changes, expected):
    result = snakemake("-n", "report", "--configfile", str(write_config(tmp_path, **changes)))
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("config_args", CONFIGS.values(), ids=CONFIGS.keys())
def test_dry_run_lists_the_chain_in_order(config_args):
    result = snakemake("-n", "report", "--forceall", *config_args, "--quiet", "rules")
    assert result.returncode == 0, result.stderr
    for rule in ("mask", "padding", "bucket_sweep", "profile", "report"):
        assert rule in result.stdout


@pytest.mark.parametrize("config_args", CONFIGS.values(), ids=CONFIGS.keys())
def test_lint_passes(config_args):
    # snakemake --lint exits 1 when it prints any lint
    result = snakemake("--lint", *config_args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_test_config_uses_its_own_data():
    config = yaml.safe_load((REPO / TEST_CONFIG).read_text())
    paths = [entry["path"] for entry in config["data"]["files"]]
    assert paths and all(path.startswith(".test/") and (REPO / path).is_file() for path in paths)


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = copy_workflow(tmp_path_factory.mktemp("workflow"))
    shutil.copytree(REPO / ".test", directory / ".test")
    return directory


def dry_run_in(workflow: Path, config: Path) -> subprocess.CompletedProcess:
    return snakemake(
        "-n", "report", "--configfile", str(config), cwd=workflow, snakefile=workflow / "Snakefile"
    )


@pytest.mark.parametrize("harness", ["/nonexistent.py", "no_such_package_7f3a.train"])
def test_harness_that_cannot_be_found_fails_the_dry_run_naming_the_key(
    tmp_path, workflow_copy, harness
):
    result = dry_run_in(workflow_copy, write_config(tmp_path, **{"profile.harness": harness}))
    assert result.returncode != 0
    assert "config key profile.harness: " in result.stdout + result.stderr
    assert harness in result.stdout + result.stderr
    assert not (workflow_copy / "results").exists()


@pytest.mark.parametrize(
    "harness", ["probes.reference_harness", "scripts/probes/step/reference_harness.py"]
)
def test_harness_import_path_or_file_passes_the_dry_run(tmp_path, workflow_copy, harness):
    result = dry_run_in(workflow_copy, write_config(tmp_path, **{"profile.harness": harness}))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "profile" in result.stdout
