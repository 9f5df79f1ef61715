"""probes.step.cluster.slurm_environment: what the profile stage records about its SLURM job."""

from __future__ import annotations

from probes.step.cluster import SLURM_VARIABLES, slurm_environment

# What slurmstepd sets in the step of a job that asked for --gpus=1 (observed on Slurm 22.05).
GPU_STEP_ENV = {
    "SLURM_JOB_ID": "8",
    "SLURM_STEP_ID": "0",
    "SLURM_CLUSTER_NAME": "probes",
    "SLURM_JOB_PARTITION": "main",
    "SLURMD_NODENAME": "vm",
    "SLURM_CPUS_ON_NODE": "1",
    "SLURM_GPUS_ON_NODE": "1",
    "SLURM_STEP_GPUS": "0",
    "CUDA_VISIBLE_DEVICES": "0",
    "PATH": "/usr/bin",
}


def test_gpu_job_records_job_id_and_visible_card():
    record = slurm_environment(GPU_STEP_ENV)
    assert record["under_slurm"] is True
    assert record["job_id"] == "8"
    assert record["step_id"] == "0"
    assert record["node"] == "vm"
    assert record["partition"] == "main"
    assert record["gpus_on_node"] == "1"
    assert record["step_gpus"] == "0"
    assert record["cuda_visible_devices"] == "0"


def test_outside_slurm_every_key_is_present_and_none():
    record = slurm_environment({"PATH": "/usr/bin"})
    assert record["under_slurm"] is False
    assert set(record) == set(SLURM_VARIABLES) | {"under_slurm", "cuda_visible_devices"}
    assert all(record[key] is None for key in SLURM_VARIABLES)
    assert record["cuda_visible_devices"] is None


def test_empty_cuda_visible_devices_is_kept_distinct_from_unset():
    # "" hides every card: a run that saw no GPU must say so, not look unpinned.
    assert slurm_environment({"CUDA_VISIBLE_DEVICES": ""})["cuda_visible_devices"] == ""
    assert slurm_environment({"SLURM_JOB_ID": ""})["under_slurm"] is False


def test_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    record = slurm_environment()
    assert record["job_id"] == "4242"
    assert record["cuda_visible_devices"] == "1"


def test_record_is_json_serialisable():
    import json

    assert json.loads(json.dumps(slurm_environment(GPU_STEP_ENV)))["job_id"] == "8"
