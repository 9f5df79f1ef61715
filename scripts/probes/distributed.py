"""Can this machine host a W-rank data-parallel job? One clear message before anything starts.

Used by the data_parallel stage (``probes.dp.stage``) and ``bench/ddp_step.py``:
gloo runs one CPU process per rank and needs a core for each (one thread per rank); NCCL needs a
CUDA device per rank; either backend must be compiled into the installed torch.
"""

from __future__ import annotations

import os

from probes.errors import ProbeError

BACKENDS = ("gloo", "nccl")


class LaunchError(ProbeError, RuntimeError):
    """A data-parallel job this machine cannot run; the message says what to change."""


def launch_problem(
    world_size: int,
    backend: str,
    cpu_count: int,
    cuda_devices: int,
    available: dict[str, bool],
) -> str | None:
    """Why a ``world_size``-rank job on ``backend`` cannot run here, or None when it can."""
    if backend not in BACKENDS:
        return f"backend {backend!r} is not one of {list(BACKENDS)}"
    if not available.get(backend, False):
        return (
            f"backend {backend!r} is not available in this torch build "
            f"(available: {[b for b in BACKENDS if available.get(b)] or 'none'}); "
            + ("use gloo on CPU" if backend == "nccl" else "install a torch with distributed")
        )
    if world_size < 1:
        return f"world_size={world_size}: the number of ranks must be >= 1"
    if backend == "nccl" and world_size > cuda_devices:
        return (
            f"world_size={world_size} ranks on nccl need {world_size} CUDA devices; "
            f"this machine has {cuda_devices}: lower world_size or run on a larger node"
        )
    if backend == "gloo" and world_size > cpu_count:
        return (
            f"world_size={world_size} gloo ranks (one thread each) need {world_size} "
            f"CPU cores; this machine has {cpu_count}: lower world_size"
        )
    return None


def check_launch(world_size: int, backend: str) -> None:
    """Raise LaunchError naming the problem when this machine cannot host the job."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available()
    available = {
        "gloo": distributed and dist.is_gloo_available(),
        "nccl": distributed and dist.is_nccl_available() and torch.cuda.is_available(),
    }
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = launch_problem(world_size, backend, os.cpu_count() or 1, cuda, available)
    if problem:
        raise LaunchError(problem)
