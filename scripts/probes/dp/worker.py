"""One rank of the data_parallel stage, launched by torchrun as a module
(``torchrun ... -m probes.dp.worker JOB.json``, with ``scripts/`` on PYTHONPATH).

The rank runs one of two steps, both behind ``Rank``'s small interface: the user's trainer
(``probes.dp.trainer``: built by its factory or command under the process group, its per-rank
micro-batches from its own ``get_train_dataloader``, wrapped by its own accelerator in DDP or
FSDP2) where ``trainer.factory`` / ``trainer.command`` is set, else the ``profile.harness``
module (``probes.dp.harness``: its loss in DDP, the stage's shard of the plans). Per rank:

1. **one process**: each sampled step's micro-batches, forward + backward on the model before
   it is wrapped (no communication), each round: ``single_s`` per step;
2. the model wrapped (DDP, or FSDP2's ``fully_shard``);
3. **distributed**: each sampled step after a barrier, ``no_sync`` on all but the last
   micro-batch (what the trainer's loop does), then the optimizer step (timed: a local cost).
   Under DDP a communication hook times the rank's **wait** (a barrier, until the slowest rank's
   gradients are ready) and the **collective** (the all-reduce); FSDP2 meets at every layer's
   all-gather, so its wait and communication are derived by the stage (probes.dp.predict).

Writes ``rank<R>.json`` (records + where it ran) into the job's out directory; on any error
``rank<R>.error`` (the traceback) and exit 1, which makes torchrun stop the other ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class RankStep:
    """One sampled optimizer step on this rank: its micro-batches, ready for the step."""

    strategy: str
    index: int  # the step's position in the rank's epoch
    batches: list[Any]
    padded_tokens: int
    real_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the trainer's num_items_in_batch


class Rank(Protocol):
    """What the worker asks of a rank's step (probes.dp.harness, probes.dp.trainer)."""

    sharding: str

    def plans(self) -> list[RankStep]: ...

    def local(self, step: RankStep) -> None:
        """Forward + backward of one micro-batch set on the unwrapped model, no communication."""

    def clear(self) -> None:
        """Drop the gradients the local pass left."""

    def wrap(self, record: dict[str, float], sync: Callable[[], None]) -> bool:
        """DDP or FSDP2 around the model; True where a DDP hook adds to ``record`` this
        rank's wait and collective (timed_allreduce_hook)."""

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager: ...

    def forward_backward(self, step: RankStep, batch: Any) -> None: ...

    def optimizer_step(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def wrapped(self) -> dict[str, Any]:
        """How the model was wrapped (DDP settings, the FSDP2 plugin), for where it ran."""


def timed_allreduce_hook(record: dict[str, float], world: int, sync=lambda: None):
    """A DDP communication hook that averages each gradient bucket by all-reduce, adding to
    ``record["wait"]`` this rank's wait for the slowest rank (a barrier first) and to
    ``record["collective"]`` the all-reduce itself. ``sync`` waits for the device (CUDA)."""
    import torch.distributed as dist

    def hook(_state, bucket):
        sync()
        start = time.perf_counter()
        dist.barrier()  # until the slowest rank's gradients are ready: this rank's wait
        ready = time.perf_counter()
        buffer = bucket.buffer()
        dist.all_reduce(buffer)
        buffer.div_(world)
        sync()
        record["wait"] += ready - start
        record["collective"] += time.perf_counter() - ready
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


class Timer:
    """Times a rank's steps both ways: alone (unwrapped) and distributed (wrapped)."""

    def __init__(self, rank: Rank, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.record = {"wait": 0.0, "collective": 0.0}
        self.hooked = False  # FSDP2: no hook; the stage derives the wait

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def single_s(self, step: RankStep) -> float:
        """The step's micro-batches, forward + backward on the unwrapped model."""
        self.sync()
        start = time.perf_counter()
        self.rank.local(step)
        self.sync()
        elapsed = time.perf_counter() - start
        self.rank.clear()
        return elapsed

    def distributed(self, step: RankStep) -> dict[str, float]:
        """One step after a barrier (no_sync on all but the last micro-batch), then the
        optimizer: the step, this rank's wait, the collective and the optimizer's time."""
        import torch.distributed as dist

        self.record.update(wait=0.0, collective=0.0)
        dist.barrier()
        self.sync()
        start = time.perf_counter()
        last = len(step.batches) - 1
        for k, batch in enumerate(step.batches):
            with self.rank.no_sync(k == last):
                self.rank.forward_backward(step, batch)
        self.sync()
        before_optimizer = time.perf_counter()
        self.rank.optimizer_step()
        self.sync()
        end = time.perf_counter()
        return {
            "step_s": end - start,
            "wait_s": self.record["wait"] if self.hooked else float("nan"),
            "collective_s": self.record["collective"] if self.hooked else float("nan"),
            "optimizer_s": end - before_optimizer,
        }


def rounds(job: dict[str, Any]) -> Iterator[tuple[int, bool]]:
    """(round index, measured) for the warm-up rounds, then the measured ones."""
    warmup = int(job["warmup_rounds"])
    for index in range(warmup + int(job["rounds"])):
        yield index - warmup, index >= warmup


def progress(rank: int, world: int, total: int, sharding: str | None) -> Any:
    """Rank 0's progress over its optimizer steps, one process then distributed (the stage
    passes the ranks' stderr through); the other ranks' bars are off."""
    from tqdm import tqdm

    label = f"data_parallel {sharding or 'ddp'}, rank 0 of {world}"
    return tqdm(total=total, desc=label, disable=rank != 0, mininterval=5.0, file=sys.stderr)


def run_rank(job: dict[str, Any], rank: int, local_rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    device = _init_rank(job, local_rank)
    step_of = load_rank(job, rank, world, device)
    timer = Timer(step_of, device)
    steps = step_of.plans()
    bar = progress(rank, world, 2 * len(list(rounds(job))) * len(steps), step_of.sharding)
    single: dict[tuple[int, str, int], float] = {}
    for round_index, measured in rounds(job):
        for step in steps:  # one process: no communication, each step alone
            seconds = timer.single_s(step)
            bar.update()
            if measured:
                single[(round_index, step.strategy, step.index)] = seconds
    timer.hooked = step_of.wrap(timer.record, timer.sync)
    records = []
    for round_index, measured in rounds(job):
        for step in steps:  # distributed: every rank starts the step together
            timed = timer.distributed(step)
            bar.update()
            if measured:
                records.append(
                    {
                        "sharding": step_of.sharding,
                        "strategy": step.strategy,
                        "round": round_index,
                        "step": step.index,
                        "rank": rank,
                        **timed,
                        "single_s": single[(round_index, step.strategy, step.index)],
                        "n_micro_batches": len(step.batches),
                        "padded_tokens": step.padded_tokens,
                        "real_tokens": step.real_tokens,
                    }
                )
    bar.close()
    where = _where(rank, local_rank, device, step_of.wrapped())
    dist.barrier()
    dist.destroy_process_group()
    return {"records": records, "where": where, "timed_step": step_of.describe()}


def load_rank(job: dict[str, Any], rank: int, world: int, device: torch.device) -> Rank:
    """The trainer's rank where the job names a trainer, else the harness's."""
    if job.get("trainer"):
        from probes.dp.trainer import TrainerRank

        return TrainerRank.build(job, rank, world, device)
    from probes.dp.harness import HarnessRank

    return HarnessRank.build(job, rank, world, device)


def _init_rank(job: dict[str, Any], local_rank: int) -> torch.device:
    """This rank's device (its threads on CPU) and the process group."""
    import torch.distributed as dist

    if job["device_type"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(int(job["threads_per_rank"]))
        device = torch.device("cpu")
    dist.init_process_group(job["backend"], timeout=timedelta(seconds=float(job["timeout_s"])))
    return device


def _where(
    rank: int, local_rank: int, device: torch.device, wrapped: dict[str, Any]
) -> dict[str, Any]:
    """Where this rank ran: host, process, device, threads, the wrap's settings, SLURM job."""
    from probes.step.cluster import slurm_environment

    cuda = device.type == "cuda"
    return {
        "rank": rank,
        "local_rank": local_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device) if not cuda else f"{device} ({torch.cuda.get_device_name(device)})",
        "threads": torch.get_num_threads(),
        **wrapped,
        "slurm": slurm_environment(),
    }


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out_dir"])
    rank = int(os.environ["RANK"])
    try:
        result = run_rank(job, rank, int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
