"""Where a stage ran: the SLURM job and the GPU it was given, read from the environment.

The profile stage records this in results/profile/provenance.json under "slurm", so a number
measured on a cluster can be traced to its job, node and card. SLURM sets CUDA_VISIBLE_DEVICES
only for a job (or step) that was allocated a GPU, which makes it the proof that the GPU request
reached the scheduler, not just the Snakefile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# provenance key -> environment variable, all read as strings (None when unset).
SLURM_VARIABLES = {
    "job_id": "SLURM_JOB_ID",
    "step_id": "SLURM_STEP_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "cluster": "SLURM_CLUSTER_NAME",
    "partition": "SLURM_JOB_PARTITION",
    "node": "SLURMD_NODENAME",
    "cpus_on_node": "SLURM_CPUS_ON_NODE",
    "job_gpus": "SLURM_JOB_GPUS",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
    "step_gpus": "SLURM_STEP_GPUS",
}


def slurm_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The SLURM job this process runs in, and the GPUs it may see.

    Returns {"under_slurm": bool, "job_id": str | None, ..., "cuda_visible_devices": str | None}
    with every key of SLURM_VARIABLES present (None when unset), so a reader never needs
    `.get`. CUDA_VISIBLE_DEVICES is recorded also outside SLURM: a local run pinned to one card
    says which one.
    """
    env = os.environ if environ is None else environ
    record: dict[str, Any] = {key: _non_empty(env.get(var)) for key, var in SLURM_VARIABLES.items()}
    record["under_slurm"] = record["job_id"] is not None
    # An empty CUDA_VISIBLE_DEVICES hides every card; keep "" distinct from unset.
    record["cuda_visible_devices"] = env.get("CUDA_VISIBLE_DEVICES")
    return record


def _non_empty(value: str | None) -> str | None:
    return value if value else None
