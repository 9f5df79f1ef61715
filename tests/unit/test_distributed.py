"""The data-parallel launch check: one message per thing the machine cannot host."""

import pytest

from probes import distributed

BOTH = {"gloo": True, "nccl": True}


@pytest.mark.parametrize(
    ("world", "backend", "cpus", "gpus", "available", "message"),
    [
        (2, "gloo", 2, 0, BOTH, None),
        (3, "gloo", 2, 0, BOTH, "need 3 CPU cores; this machine has 2"),
        (2, "nccl", 16, 1, BOTH, "need 2 CUDA devices; this machine has 1"),
        (2, "nccl", 16, 0, {"gloo": True, "nccl": False}, "'nccl' is not available"),
        (2, "mpi", 16, 0, BOTH, "not one of"),
        (0, "gloo", 2, 0, BOTH, "must be >= 1"),
    ],
)
def test_launch_problem(world, backend, cpus, gpus, available, message):
    problem = distributed.launch_problem(world, backend, cpus, gpus, available)
    if message is None:
        assert problem is None
    else:
        assert message in problem


def test_check_launch_refuses_more_gloo_ranks_than_cores():
    pytest.importorskip("torch")
    with pytest.raises(distributed.LaunchError, match="CPU cores"):
        distributed.check_launch(10_000, "gloo")
