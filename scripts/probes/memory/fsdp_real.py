"""The real per-rank peak of one FSDP2 training step: W CPU processes on gloo.

The check of `probes.memory.fsdp`: the same model (random init, from the same config), sharded
the same way (`probes.memory.fsdp.shard`), the same harness functions, one step after the
optimizer's states exist; each rank measured by the instrument the single-process check uses
(`probes.memory.real.cpu_allocator_peak`: the profiler's allocator events over the step) plus the
bytes of its local shards, states and batch live before the step. Ranks are started with
`torch.multiprocessing` (spawn), rendezvous through a file, one thread each.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from probes.memory.predict import Shape, functions_of, make_batch, warm_optimizer


def local(tensor: Any) -> Any:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def live_before(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> int:
    from probes.memory.real import storage_bytes

    tensors: list[Any] = [local(p) for p in model.parameters()]
    tensors += list(model.buffers())
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values()]
    tensors += list(batch.values())
    return storage_bytes(tensors)


def _rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank: build, shard, warm, measure one step; writes rank<r>.json into job['out']."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from probes.mask.trace import config_from_dict
    from probes.memory.fsdp import Sharding, shard
    from probes.memory.real import cpu_allocator_peak

    torch.set_num_threads(1)
    world = int(job["world_size"])
    dist.init_process_group(
        "gloo", init_method=f"file://{job['rendezvous']}", rank=rank, world_size=world
    )
    try:
        harness = importlib.import_module(job["harness"])
        if hasattr(harness, "configure"):
            harness.configure(dict(job["options"]))
        functions = functions_of(harness)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config_from_dict(dict(job["config"])), dtype=torch.float32, attn_implementation="sdpa"
        )
        if functions.apply_adapters is not None:
            model = functions.apply_adapters(model, functions.discover_target_modules(model))
        sharding = Sharding(world, bool(job["reshard_after_forward"]))
        root = shard(model, functions.compute_loss, init_device_mesh("cpu", (world,)), sharding)
        root.train()
        optimizer = functions.build_optimizer(model)
        warm_optimizer(model, optimizer)
        shape = Shape(**job["shape"])
        batch = make_batch(shape)
        vocab = int(job["config"]["vocab_size"])
        batch["input_ids"] = torch.randint(0, vocab, batch["input_ids"].shape)
        batch["labels"] = batch["input_ids"].clone()

        def step() -> None:
            loss = root(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        base = live_before(model, optimizer, batch)
        peak = base + cpu_allocator_peak(step)
        Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak}))
    finally:
        dist.destroy_process_group()


def real_sharded_peaks(
    config: dict[str, Any],
    harness: str,
    options: dict[str, Any],
    shape: Shape,
    world_size: int,
    reshard_after_forward: bool = True,
) -> list[int]:
    """Each rank's real peak bytes of one FSDP2 step of `config` (float32, CPU, gloo) through
    the harness module `harness` (an import path) configured with `options`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp-real-") as out:
        job = {
            "world_size": world_size,
            "rendezvous": os.path.join(out, "rendezvous"),
            "harness": harness,
            "options": options,
            "config": config,
            "shape": asdict(shape),
            "reshard_after_forward": reshard_after_forward,
            "out": out,
        }
        mp.spawn(_rank_main, args=(job,), nprocs=world_size, join=True)
        return [
            int(json.loads(Path(out, f"rank{r}.json").read_text())["peak_bytes"])
            for r in range(world_size)
        ]
