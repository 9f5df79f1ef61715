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
    from torch.nn.parallel import DistributedDataParallel

    from probes.step import batches as bt
    from probes.step.cluster import slurm_environment

    cuda = job["device_type"] == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(int(job["threads_per_rank"]))
        device = torch.device("cpu")
    dist.init_process_group(job["backend"], timeout=timedelta(seconds=float(job["timeout_s"])))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    model, harness, optimizer, vocab, pad_id, described = load_model(job, device)
    # broadcast_buffers=False: a causal LM's buffers (rotary frequencies) are constants, and a
    # broadcast at every forward would be a collective inside the one-process timings and a
    # meeting point per micro-batch; with it off the ranks meet only at the gradient all-reduce
    ddp = DistributedDataParallel(
        HarnessLoss(model, harness.compute_loss),
        device_ids=[local_rank] if cuda else None,
        broadcast_buffers=False,
    )
    record = {"wait": 0.0, "collective": 0.0}
    hook = timed_allreduce_hook(record, world, sync)
    ddp.register_comm_hook(None, hook)
    generator = torch.Generator().manual_seed(int(job["seed"]) + rank)

    def batch_of(micro: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        built = bt.padded_batch(micro["lengths"], micro["loss"], vocab, generator, pad_id=pad_id)
        return bt.to_device(built, device)

    records = []
    for round_index in range(int(job["warmup_rounds"]) + int(job["rounds"])):
        measured = round_index >= int(job["warmup_rounds"])
        for name, per_rank in job["strategies"].items():
            steps = per_rank[rank]
            single = []
            for step in steps:  # one process: no communication, each micro-batch alone
                total = 0.0
                for micro in step:
                    batch = batch_of(micro)
                    sync()
                    start = time.perf_counter()
                    with ddp.no_sync():
                        ddp(batch).backward()
                    sync()
                    total += time.perf_counter() - start
                optimizer.zero_grad(set_to_none=True)
                single.append(total)
            for index, step in enumerate(steps):  # DDP: every rank starts the step together
                built = [batch_of(micro) for micro in step]
                record.update(wait=0.0, collective=0.0)
                dist.barrier()
                sync()
                start = time.perf_counter()
                for k, batch in enumerate(built):
                    if k < len(built) - 1:
                        with ddp.no_sync():
                            ddp(batch).backward()
                    else:
                        ddp(batch).backward()
                sync()
                before_optimizer = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                end = time.perf_counter()
                if measured:
                    records.append(
                        {
                            "strategy": name,
                            "round": round_index - int(job["warmup_rounds"]),
                            "step": int(job["step_indices"][name][index]),
                            "rank": rank,
                            "step_s": end - start,
                            "wait_s": record["wait"],
                            "collective_s": record["collective"],
                            "optimizer_s": end - before_optimizer,
                            "single_s": single[index],
                            "n_micro_batches": len(step),
                            "padded_tokens": sum(
                                len(m["lengths"]) * max(m["lengths"]) for m in step
                            ),
                            "real_tokens": sum(sum(m["lengths"]) for m in step),
                        }
                    )
    where = {
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
    dist.barrier()
    dist.destroy_process_group()
    return {"records": records, "where": where, "harness": described}


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
