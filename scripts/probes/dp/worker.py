"""One rank of the data_parallel stage, launched by torchrun as a module
(``torchrun ... -m probes.dp.worker JOB.json``, with ``scripts/`` on PYTHONPATH).

Each rank loads the real model through the user's harness (``probes.step``: the profiled dtype,
the harness's adapters and optimizer), wraps ``compute_loss`` in ``DistributedDataParallel`` (so
the harness's own loss runs inside DDP's forward), and for every round:

1. **one process**: each of its sampled steps' micro-batches, forward + backward under
   ``no_sync`` (no communication), timed alone: ``single_s`` per step;
2. **DDP**: each sampled step after a barrier, ``no_sync`` on all but the last micro-batch (what
   ``accelerator.accumulate`` does; no buffer broadcast); a communication hook times the
   rank's **wait** (a barrier, until the slowest rank's gradients are ready) and the
   **collective** (the all-reduce); then the optimizer step (timed: a local, one-process cost).

Writes ``rank<R>.json`` (records + where it ran) into the job's out directory; on any error
``rank<R>.error`` (the traceback) and exit 1, which makes torchrun stop the other ranks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class HarnessLoss(torch.nn.Module):
    """``forward(batch) = harness.compute_loss(model, batch)``: DDP wraps the harness's loss, so
    whatever the harness calls inside the model runs under DDP's forward and backward hooks."""

    def __init__(self, model: torch.nn.Module, compute_loss) -> None:
        super().__init__()
        self.model = model
        self._compute_loss = compute_loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._compute_loss(self.model, batch)


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


def load_model(job: dict[str, Any], device: torch.device):
    """The real model, the user's harness, its adapters and optimizer (probes.step)."""
    from probes.step import runner as ts

    # the same seed on every rank: the same adapters (DDP broadcasts them too)
    model, harness, optimizer, targets, _ = ts.load_for_steps(
        job["model_path"],
        job["profile"],
        device,
        DTYPES[job["dtype"]],
        job["dtype_reason"],
        seed=int(job["seed"]),
    )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    pad_id = int(getattr(config or model.config, "pad_token_id", None) or 0)
    vocab = int(model.get_input_embeddings().num_embeddings)
    described = {**harness.describe(), "target_modules": len(targets)}
    return model, harness, optimizer, vocab, pad_id, described


def run_rank(job: dict[str, Any], rank: int, local_rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    device = _init_rank(job, local_rank)
    model, harness, optimizer, vocab, pad_id, described = load_model(job, device)
    timer = _StepTimer.wrap(model, harness, optimizer, device, local_rank, world)
    generator = torch.Generator().manual_seed(int(job["seed"]) + rank)

    def batch_of(micro: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        from probes.step import batches as bt

        built = bt.padded_batch(micro["lengths"], micro["loss"], vocab, generator, pad_id=pad_id)
        return bt.to_device(built, device)

    warmup = int(job["warmup_rounds"])
    records = []
    for round_index in range(warmup + int(job["rounds"])):
        for name, per_rank in job["strategies"].items():
            steps = per_rank[rank]
            # one process: no communication, each micro-batch alone
            single = [timer.single_s([batch_of(micro) for micro in step]) for step in steps]
            for index, step in enumerate(steps):  # DDP: every rank starts the step together
                timed = timer.ddp_step([batch_of(micro) for micro in step])
                if round_index >= warmup:
                    records.append(
                        {
                            "strategy": name,
                            "round": round_index - warmup,
                            "step": int(job["step_indices"][name][index]),
                            "rank": rank,
                            **timed,
                            "single_s": single[index],
                            "n_micro_batches": len(step),
                            "padded_tokens": sum(
                                len(m["lengths"]) * max(m["lengths"]) for m in step
                            ),
                            "real_tokens": sum(sum(m["lengths"]) for m in step),
                        }
                    )
    where = _where(rank, local_rank, device, timer.ddp)
    dist.barrier()
    dist.destroy_process_group()
    return {"records": records, "where": where, "harness": described}


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


class _StepTimer:
    """The harness's loss in DDP with the timed all-reduce hook; times a step both ways."""

    def __init__(self, ddp: Any, optimizer: Any, record: dict[str, float], device: Any) -> None:
        self.ddp, self.optimizer, self.record, self.device = ddp, optimizer, record, device

    @classmethod
    def wrap(cls, model, harness, optimizer, device, local_rank: int, world: int) -> _StepTimer:
        from torch.nn.parallel import DistributedDataParallel

        cuda = device.type == "cuda"
        # broadcast_buffers=False: a causal LM's buffers (rotary frequencies) are constants, and a
        # broadcast at every forward would be a collective inside the one-process timings and a
        # meeting point per micro-batch; with it off the ranks meet only at the gradient all-reduce
        ddp = DistributedDataParallel(
            HarnessLoss(model, harness.compute_loss),
            device_ids=[local_rank] if cuda else None,
            broadcast_buffers=False,
        )
        record = {"wait": 0.0, "collective": 0.0}
        timer = cls(ddp, optimizer, record, device)
        ddp.register_comm_hook(None, timed_allreduce_hook(record, world, timer.sync))
        return timer

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def single_s(self, batches: list[dict[str, torch.Tensor]]) -> float:
        """One optimizer step's micro-batches, forward + backward each alone under no_sync."""
        total = 0.0
        for batch in batches:
            self.sync()
            start = time.perf_counter()
            with self.ddp.no_sync():
                self.ddp(batch).backward()
            self.sync()
            total += time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def ddp_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One DDP step after a barrier (no_sync on all but the last micro-batch), then the
        optimizer: the step, this rank's wait, the all-reduce and the optimizer's time."""
        import torch.distributed as dist

        self.record.update(wait=0.0, collective=0.0)
        dist.barrier()
        self.sync()
        start = time.perf_counter()
        for k, batch in enumerate(batches):
            if k < len(batches) - 1:
                with self.ddp.no_sync():
                    self.ddp(batch).backward()
            else:
                self.ddp(batch).backward()
        self.sync()
        before_optimizer = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        end = time.perf_counter()
        return {
            "step_s": end - start,
            "wait_s": self.record["wait"],
            "collective_s": self.record["collective"],
            "optimizer_s": end - before_optimizer,
        }


def _where(rank: int, local_rank: int, device: torch.device, ddp: Any) -> dict[str, Any]:
    """Where this rank ran: host, process, device, threads, DDP settings, SLURM job."""
    from probes.step.cluster import slurm_environment

    cuda = device.type == "cuda"
    return {
        "rank": rank,
        "local_rank": local_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device) if not cuda else f"{device} ({torch.cuda.get_device_name(device)})",
        "threads": torch.get_num_threads(),
        "ddp": {
            "broadcast_buffers": False,
            "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
            "comm_hook": "timed all-reduce",
        },
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
