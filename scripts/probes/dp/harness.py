"""The harness's rank of the data_parallel stage (no trainer given): the real model through the
``profile.harness`` module (probes.step: the profiled dtype, its adapters and optimizer), its
``compute_loss`` wrapped in ``DistributedDataParallel`` (so whatever the harness calls inside
the model runs under DDP's hooks), and this rank's shard of the bucket stage's plans
(``probes.dp.shard``, accelerate's sharding) as padded micro-batches of random token ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from probes.dp.sharding import DDP
from probes.dp.worker import DTYPES, RankStep, timed_allreduce_hook


class HarnessLoss(torch.nn.Module):
    """``forward(batch) = harness.compute_loss(model, batch)``: DDP wraps the harness's loss, so
    whatever the harness calls inside the model runs under DDP's forward and backward hooks."""

    def __init__(self, model: torch.nn.Module, compute_loss) -> None:
        super().__init__()
        self.model = model
        self._compute_loss = compute_loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._compute_loss(self.model, batch)


class HarnessRank:
    """probes.dp.worker.Rank for the harness."""

    sharding = DDP

    def __init__(self, job, rank, world, device, model, harness, optimizer, described) -> None:
        self.job, self.rank, self.world, self.device = job, rank, world, device
        self.loss = HarnessLoss(model, harness.compute_loss)
        self.optimizer = optimizer
        self.described = described
        self.ddp: Any = None

    @classmethod
    def build(cls, job: dict[str, Any], rank: int, world: int, device: torch.device):
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
        described = {**harness.describe(), "kind": "harness", "target_modules": len(targets)}
        return cls(job, rank, world, device, model, harness, optimizer, described)

    def plans(self) -> list[RankStep]:
        """This rank's sampled steps of every strategy, as padded batches (built once)."""
        from probes.step import batches as bt
        from probes.step.runner import model_text_config

        text = model_text_config(self.loss.model)
        vocab = int(self.loss.model.get_input_embeddings().num_embeddings)
        pad_id = int(text.get("pad_token_id") or 0)
        generator = torch.Generator().manual_seed(int(self.job["seed"]) + self.rank)
        steps = []
        for name, per_rank in self.job["strategies"].items():
            for index, micro in zip(
                self.job["step_indices"][name], per_rank[self.rank], strict=True
            ):
                batches = [
                    bt.to_device(
                        bt.padded_batch(m["lengths"], m["loss"], vocab, generator, pad_id=pad_id),
                        self.device,
                    )
                    for m in micro
                ]
                padded = sum(len(m["lengths"]) * max(m["lengths"]) for m in micro)
                real = sum(sum(m["lengths"]) for m in micro)
                steps.append(RankStep(name, int(index), batches, padded, real))
        return steps

    def local(self, step: RankStep) -> None:
        for batch in step.batches:
            self.loss(batch).backward()

    def clear(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def wrap(self, record: dict[str, float], sync: Callable[[], None]) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        cuda = self.device.type == "cuda"
        # broadcast_buffers=False: a causal LM's buffers (rotary frequencies) are constants, and a
        # broadcast at every forward would be a meeting point per micro-batch; with it off the
        # ranks meet only at the gradient all-reduce
        self.ddp = DistributedDataParallel(
            self.loss,
            device_ids=[self.device.index] if cuda else None,
            broadcast_buffers=False,
        )
        self.ddp.register_comm_hook(None, timed_allreduce_hook(record, self.world, sync))
        return True

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def forward_backward(self, step: RankStep, batch: Any) -> None:
        self.ddp(batch).backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        return self.described

    def wrapped(self) -> dict[str, Any]:
        return {
            "sharding": self.sharding,
            "ddp": {
                "broadcast_buffers": False,
                "bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20,
                "comm_hook": "timed all-reduce",
            },
        }
