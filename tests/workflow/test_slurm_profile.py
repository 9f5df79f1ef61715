"""The cluster profile asks for a GPU for the GPU rules (`profile`, `replay`, `realize`) only,
and for W GPUs and W cores in one task for `data_parallel` when training.world_size = W > 1;
locally `--resources gpu=1` keeps GPU jobs from overlapping on one card. No SLURM needed: see
test_slurm_cluster.py for the real one."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_workflow

CLUSTER_PROFILE = REPO / "config" / "profiles" / "slurm" / "config.yaml"
# Where Snakemake may pick up a workflow profile for this layout (Snakefile at the top level
# searches profiles/default; workflow/profiles/default is where the design puts it).
WORKFLOW_PROFILES = [
    REPO / "workflow" / "profiles" / "default" / "config.yaml",
    REPO / "profiles" / "default" / "config.yaml",
]
GPU_KEYS = {"gpu", "gpus", "gres", "gpu_model"}
# The rules that time the model on a card.
GPU_RULES = {"profile", "replay", "realize"}
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def test_cluster_profile_uses_slurm_and_asks_for_a_gpu_for_gpu_rules_only():
    profile = yaml.safe_load(CLUSTER_PROFILE.read_text())
    assert profile["executor"] == "slurm"
    assert set(profile["set-resources"]) == GPU_RULES | {"data_parallel"}
    assert all(profile["set-resources"][rule]["gpu"] == 1 for rule in GPU_RULES)
    # its GPU count depends on training.world_size: the rule says it, a fixed one here would win
    assert not GPU_KEYS & set(profile["set-resources"]["data_parallel"])
    assert not GPU_KEYS & set(profile["default-resources"]), "CPU stages must ask for no GPU"
    assert {"runtime", "mem_mb"} <= set(profile["default-resources"])


@pytest.mark.parametrize("path", WORKFLOW_PROFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_workflow_profile_does_not_replace_the_cluster_resources(path):
    # Snakemake merges the workflow profile over --profile per key: a `set-resources` (or
    # `default-resources`) here would silently drop the cluster profile's GPU request.
    if not path.exists():
        pytest.skip(f"{path.relative_to(REPO)} does not exist")
    profile = yaml.safe_load(path.read_text()) or {}
    assert "set-resources" not in profile
    assert "default-resources" not in profile


def dry_run(args: list[str], cwd: Path) -> str:
    """A dry run's job listing (stdout and stderr)."""
    result = subprocess.run(
        [*SNAKEMAKE, "--dry-run", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def listed(listing: str, key: str = "resources") -> dict[str, str]:
    """rule name -> its `resources:` (or `threads:`) line in a dry run's job listing."""
    resources, rule = {}, None
    for line in listing.splitlines():
        if match := re.match(r"(?:local)?rule (\w+):$", line):
            rule = match.group(1)
        elif rule and (match := re.match(rf"\s+{key}: (.*)$", line)):
            resources[rule] = match.group(1)
    return resources


def dry_run_resources(args: list[str], cwd: Path, key: str = "resources") -> dict[str, str]:
    """rule name -> its `resources:` (or `threads:`) line, from a dry run's job listing."""
    return listed(dry_run(args, cwd), key)


@pytest.fixture(scope="module")
def default_cluster_listing(tmp_path_factory) -> str:
    """`snakemake --dry-run --profile config/profiles/slurm report` on the default config, once
    for the tests that read it."""
    workdir = tmp_path_factory.mktemp("slurm-default") / "repo"
    copy_workflow(workdir)
    return dry_run(["--profile", "config/profiles/slurm", "report"], workdir)


def resource_names(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split(", "))


def test_dry_run_under_the_cluster_profile_requests_a_gpu_for_gpu_rules_only(
    default_cluster_listing,
):
    # The default config: its model and data come from rules, so the DAG is complete.
    resources = listed(default_cluster_listing)
    assert {"mask", "padding", "bucket_sweep", "report"} | GPU_RULES <= set(resources)
    for rule, line in resources.items():
        names = resource_names(line)
        if rule in GPU_RULES:
            assert names.get("gpu") == "1", line
        else:
            assert not GPU_KEYS & set(names), f"rule {rule} asks for a GPU: {line}"


class Resources(dict):
    """A job's resources as the SLURM plugin reads them (`.get` and attributes)."""

    __getattr__ = dict.get


def sbatch_options(resources: dict, threads: int) -> str:
    """The sbatch options snakemake-executor-plugin-slurm builds for a job with these resources
    (its own get_submit_command and set_gres_string, no cluster needed)."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = types.SimpleNamespace(resources=Resources(resources), threads=threads)
    params = {
        "run_uuid": "u",
        "slurm_logfile": "log",
        "comment_str": "rule_data_parallel",
        "account": "",
        "partition": "",
        "workdir": "",
    }
    return get_submit_command(job, params) + set_gres_string(job)


@pytest.mark.parametrize(
    ("device", "gpus"), [("auto", "2"), ("cpu", None)], ids=["gpu run", "cpu run"]
)
def test_data_parallel_asks_for_w_gpus_and_w_cores_in_one_task(tmp_path, device, gpus):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    workdir = tmp_path / "repo"
    copy_workflow(workdir)
    (workdir / "dp.yaml").write_text(
        yaml.safe_dump({"training": {"world_size": 2}, "profile": {"device": device}})
    )
    args = ["report", "--profile", "config/profiles/slurm", "--configfile", "dp.yaml"]
    # the workflow profile's local `resources: gpu=1` caps every job's gpu (the cluster profile
    # cannot lift it): a W-GPU job needs --resources gpu=W on the command line, last
    capped = resource_names(dry_run_resources(args, workdir)["data_parallel"])
    assert capped.get("gpu", "0") == ("1" if gpus else "0")
    args += ["--resources", "gpu=2"]
    listing = dry_run(args, workdir)  # one dry run for both the resources and the threads
    resources = resource_names(listed(listing)["data_parallel"])
    threads = int(listed(listing, key="threads")["data_parallel"])
    assert threads == 2
    assert resources.get("gpu", "0") == (gpus or "0")
    options = sbatch_options({k: int(v) if v.isdigit() else v for k, v in resources.items()}, 2)
    assert "--cpus-per-task=2" in options
    assert "--ntasks-per-gpu" not in options, "W tasks would run the job W times"
    if gpus:
        assert f"--gpus={gpus}" in options
    else:
        assert "--gpus" not in options and "--ntasks=1" in options


def test_world_size_1_submits_no_data_parallel_job(default_cluster_listing):
    resources = listed(default_cluster_listing)
    assert "report" in resources and "data_parallel" not in resources


# Two GPU rules that are ready at the same time, on two cores. In "serial" mode each takes a
# lock directory for a second and fails if the other holds it; in "partner" mode each waits
# (bounded) to see the other start, which proves the two did overlap.
TOY_SNAKEFILE = textwrap.dedent(
    """
    MODE = config.get("mode", "serial")

    rule all:
        input: "gpu_a.done", "gpu_b.done"

    rule gpu_job:
        output: "{name}.done"
        wildcard_constraints: name="gpu_a|gpu_b"
        params: other=lambda wc: "gpu_b" if wc.name == "gpu_a" else "gpu_a"
        resources: gpu=1
        run:
            import os, time
            from pathlib import Path
            if MODE == "serial":
                os.mkdir("gpu.lock")  # raises FileExistsError if the other job holds the card
                time.sleep(1)
                os.rmdir("gpu.lock")
                Path(output[0]).write_text("ok")
            else:
                Path(f"{wildcards.name}.started").touch()
                for _ in range(300):
                    if Path(f"{params.other}.started").exists():
                        break
                    time.sleep(0.1)
                Path(output[0]).write_text(str(Path(f"{params.other}.started").exists()))
    """
)


@pytest.fixture
def toy_workflow(tmp_path: Path) -> Path:
    (tmp_path / "Snakefile").write_text(TOY_SNAKEFILE)
    return tmp_path


def run_toy(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_local_resources_gpu_1_never_overlaps_gpu_jobs(toy_workflow):
    result = run_toy(toy_workflow, "all", "--resources", "gpu=1", "--config", "mode=serial")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (toy_workflow / "gpu_a.done").read_text() == "ok"
    assert (toy_workflow / "gpu_b.done").read_text() == "ok"


@pytest.mark.slow
def test_control_without_the_limit_the_gpu_jobs_do_overlap(toy_workflow):
    # Positive control for the test above: with room for two GPU jobs both run at once.
    result = run_toy(toy_workflow, "all", "--resources", "gpu=2", "--config", "mode=partner")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (toy_workflow / "gpu_a.done").read_text() == "True"
    assert (toy_workflow / "gpu_b.done").read_text() == "True"


def test_targets_after_resources_are_swallowed(toy_workflow):
    # `--resources` takes any number of values: a target after it is read as a resource.
    swallowed = run_toy(toy_workflow, "--dry-run", "--resources", "gpu=1", "all")
    assert swallowed.returncode != 0
    placed_first = run_toy(toy_workflow, "--dry-run", "all", "--resources", "gpu=1")
    assert placed_first.returncode == 0, placed_first.stderr[-3000:]
