"""The workflow on a real single-node SLURM cluster, through config/profiles/slurm.

Starts the cluster with tools/slurm/start-cluster.sh (root, Debian, apt or SLURM installed),
runs the workflow on a tiny config so that every rule is a SLURM job, and checks from the run's
own records that only the GPU rules (`profile`, `replay`, `realize`) were submitted with a GPU
request and that the profile ran on the GPU SLURM gave it; and the data_parallel rule at
world_size 2 on CPU as one job (2 cores, one task, no GPU) in which torchrun runs both ranks of a
trainer factory's SFTTrainer under FSDP2 (the harness's DDP path is tested without SLURM, in
tests/workflow/test_data_parallel.py: one data_parallel job here keeps the serial SLURM group
short).
Skipped without root/apt/SLURM, unless PROBES_REQUIRE_SLURM=1 (then it fails).
PROBES_SLURM_KEEP=1 leaves the cluster running afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from trainer_factories import write_factory

from conftest import REPO, WIRING_TRIMS, chat_rows, copy_workflow, write_jsonl

# one worker runs them all (pytest -n 2 --dist loadgroup): the module starts and stops one cluster
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

START = REPO / "tools" / "slurm" / "start-cluster.sh"
STOP = REPO / "tools" / "slurm" / "stop-cluster.sh"
CPU_RULES = {"mask", "padding", "bucket_sweep", "memory", "report"}
GPU_RULES = {"profile", "replay", "realize"}
# Settings for this test cluster, not for a user's: no slurmdbd (so squeue, not sacct, for job
# status), no accounts, and a first status check after 1 s instead of 40 s.
TEST_CLUSTER_ARGS = [
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--slurm-no-account",
    "--slurm-keep-successful-logs",
    # the plugin logs each sbatch command line at debug level only
    "--verbose",
]
# The plugin lengthens the wait after every status check that finds no job finished by 10 s
# (checks 1, 12, 33, 64, 105 s after a submission), so each job in the chain was seen up to
# ~40 s after it ended, and the run's wall time varied by minutes. This test cluster answers
# squeue in milliseconds: check every STATUS_CHECK_S instead. Only the pacing changes; what is
# submitted, and how, is the plugin's own (the jobs themselves run plain `python -m snakemake`).
STATUS_CHECK_S = 1
SNAKEMAKE_AT_FIXED_PACE = f"""
import sys
from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor
assert isinstance(RemoteExecutor.next_seconds_between_status_checks, property), (
    "the executor interface no longer paces its status checks by this property"
)
Executor.next_seconds_between_status_checks = property(
    lambda self: {STATUS_CHECK_S}, lambda self, value: None
)
sys.argv[0] = "snakemake"
sys.exit(main())
"""


def unavailable(reason: str) -> None:
    if os.environ.get("PROBES_REQUIRE_SLURM") == "1":
        pytest.fail(f"PROBES_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.geteuid() != 0:
        unavailable("starting a SLURM cluster needs root")
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        unavailable("snakemake-executor-plugin-slurm is not installed (pip install '.[slurm]')")
    if not (shutil.which("slurmctld") or Path("/usr/sbin/slurmctld").exists()):
        if not shutil.which("apt-get"):
            unavailable("SLURM is not installed and there is no apt-get to install it")
    was_up = subprocess.run([START, "--status"], capture_output=True).returncode == 0
    started = subprocess.run([START], capture_output=True, text=True, timeout=900)
    if started.returncode == 3:
        unavailable(f"SLURM cannot be installed here: {started.stderr.strip()[-500:]}")
    assert started.returncode == 0, f"start-cluster.sh failed:\n{started.stderr[-3000:]}"
    yield
    if not was_up and os.environ.get("PROBES_SLURM_KEEP") != "1":
        subprocess.run([STOP], capture_output=True, timeout=120)


def run_under_slurm(workdir: Path, target: str, *args: str) -> tuple[float, str]:
    """Run `snakemake <target> --profile config/profiles/slurm ...` as a user would (status
    checked at a fixed pace, see SNAKEMAKE_AT_FIXED_PACE).

    Jobs inherit the submitting environment, so the venv's bin goes first on PATH. A
    CUDA_VISIBLE_DEVICES from the caller is dropped: inside a job only SLURM may set it.
    Returns (wall seconds, the run's own log).
    """
    env = os.environ.copy()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [
        sys.executable,
        "-c",
        SNAKEMAKE_AT_FIXED_PACE,
        target,
        "--profile",
        "config/profiles/slurm",
        *args,
        *TEST_CLUSTER_ARGS,
    ]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200
    )
    wall_s = time.monotonic() - start
    assert result.returncode == 0, (
        f"snakemake under SLURM failed ({wall_s:.0f} s):\n{result.stderr[-4000:]}\n"
        + slurm_job_logs_tail(workdir)
    )
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    assert logs, "snakemake wrote no log under .snakemake/log"
    return wall_s, logs[-1].read_text()


def slurm_job_logs_tail(workdir: Path) -> str:
    parts = []
    for path in sorted((workdir / ".snakemake" / "slurm_logs").rglob("*.log")):
        parts.append(f"--- {path.relative_to(workdir)}\n{path.read_text()[-1500:]}")
    return "\n".join(parts)


def submitted_jobs(log: str) -> dict[str, str]:
    """rule -> SLURM job id, from the plugin's "submitted with SLURM jobid" lines."""
    pattern = r"submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/"
    jobs: dict[str, str] = {}
    for job_id, rule in re.findall(pattern, log):
        assert rule not in jobs, f"rule {rule} was submitted twice (jobs {jobs[rule]}, {job_id})"
        jobs[rule] = job_id
    return jobs


def sbatch_options(log: str) -> dict[str, str]:
    """rule -> the sbatch options the plugin submitted it with (the command it wraps cut off)."""
    calls = {}
    for line in re.findall(r"sbatch call: (sbatch .*)", log):
        rule = re.search(r"--comment '?rule_(\w+?)'?(?:\s|$)", line)
        assert rule, f"no --comment rule_<name> in sbatch call: {line[:300]}"
        calls[rule.group(1)] = line.split(" --wrap", 1)[0]
    return calls


def gpu_request(options: str) -> str | None:
    match = re.search(r"--(?:gpus|gres)[= ](\S+)", options)
    return match.group(1) if match else None


def slurm_gpu_record(job_id: str) -> str | None:
    """The GPU SLURM itself recorded for a job (TresPerJob / JOB_GRES), None when it had none."""
    shown = subprocess.run(
        ["scontrol", "-d", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    assert shown.returncode == 0, f"scontrol show job {job_id}: {shown.stderr.strip()}"
    match = re.search(r"(?:TresPerJob|JOB_GRES)=(\S*gpu\S*)", shown.stdout)
    return match.group(1) if match else None


def assert_gpu_only_for(rules_with_gpu: set[str], cpu_rules: set[str], log: str) -> dict[str, str]:
    """Every rule was a SLURM job; only `rules_with_gpu` asked for (and got) a GPU."""
    jobs = submitted_jobs(log)
    assert set(jobs) == cpu_rules | rules_with_gpu, f"rules submitted to SLURM: {jobs}"
    options = sbatch_options(log)
    assert set(options) == set(jobs), f"sbatch calls logged for {sorted(options)}"
    for rule in rules_with_gpu:
        assert gpu_request(options[rule]) == "1", options[rule]
        assert slurm_gpu_record(jobs[rule]) is not None
    for rule in cpu_rules:
        assert gpu_request(options[rule]) is None, f"{rule}: {options[rule]}"
        assert slurm_gpu_record(jobs[rule]) is None, f"SLURM gave {rule} a GPU"
    return jobs


# As tests/test_workflow_e2e.py: the profile stage times tiny lengths on CPU (the GPU SLURM
# hands out here is fake), every other stage runs as configured.
TINY_CONFIG = {
    "training": {"micro_batch_size": 2, "grad_accum": 2, "max_seq_len": 96},
    "profile": {
        "device": "cpu",
        "cpu": {"lengths": [16, 32, 64], "warmup": 1, "repeats": 2, "threads": 1},
    },
    **WIRING_TRIMS,
}


def test_workflow_on_slurm_gpu_request_only_for_gpu_rules(
    slurm_cluster, tiny_model_dir, tmp_path, record_property
):
    """The whole workflow as SLURM jobs: only the GPU rules ask for (and get) a GPU, and the
    profile ran on the GPU SLURM gave it."""
    workdir = copy_workflow(tmp_path / "workflow")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"files": [{"path": str(data)}]},
        **TINY_CONFIG,
    }
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))

    wall_s, log = run_under_slurm(workdir, "report", "--configfile", "tiny.yaml")
    record_property("slurm_workflow_wall_s", round(wall_s, 1))
    print(f"workflow under SLURM: {wall_s:.1f} s")

    jobs = assert_gpu_only_for(GPU_RULES, CPU_RULES, log)
    provenance = json.loads((workdir / "results" / "profile" / "provenance.json").read_text())
    slurm = provenance["slurm"]
    assert slurm["job_id"] == jobs["profile"], "the profile ran in the job submitted for it"
    # Only SLURM sets it (the submitting environment had none): the GPU reached the job.
    assert slurm["cuda_visible_devices"] == "0"
    assert (workdir / "results" / "report" / "playbook-evidence.md").is_file()


def test_the_trainer_under_fsdp2_runs_its_two_ranks_in_one_slurm_job(
    slurm_cluster, tiny_model_dir, tmp_path, record_property
):
    """data_parallel with trainer.factory at world_size 2: the SFTTrainer built on both ranks of
    one SLURM job (2 cores, one task, no GPU), wrapped in FSDP2 by its own accelerator."""
    workdir = copy_workflow(tmp_path / "workflow")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    max_len = TINY_CONFIG["training"]["max_seq_len"]
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"files": [{"path": str(data)}]},
        **TINY_CONFIG,
        "training": {**TINY_CONFIG["training"], "world_size": 2},
        "trainer": {"factory": write_factory(tmp_path, tiny_model_dir, data, max_length=max_len)},
        "data_parallel": {
            "sharding": ["fsdp2"],
            "steps": 2,
            "rounds": 1,
            "warmup_rounds": 1,
            "cpu": {"max_seq_len": 32},
        },
    }
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))

    wall_s, log = run_under_slurm(workdir, "data_parallel", "--configfile", "tiny.yaml")
    record_property("slurm_trainer_fsdp2_wall_s", round(wall_s, 1))
    print(f"data_parallel (trainer, FSDP2) under SLURM: {wall_s:.1f} s")

    jobs = assert_gpu_only_for(set(), {"mask", "padding", "bucket_sweep", "data_parallel"}, log)
    options = sbatch_options(log)["data_parallel"]
    assert "--cpus-per-task=2" in options and "--ntasks=1" in options, options
    summary = json.loads((workdir / "results" / "data_parallel" / "summary.json").read_text())
    assert summary["timed_step"]["kind"] == "trainer" and set(summary["runs"]) == {"fsdp2"}
    ranks = sorted(summary["wrapped"]["fsdp2"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["slurm"]["job_id"] == jobs["data_parallel"], "both ranks ran in its job"
        assert rank["wrapper"].startswith("FSDP") and rank["fsdp"]["fsdp_version"] == 2
