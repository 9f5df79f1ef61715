"""The trainer's rank of the data_parallel stage: the user's own ``transformers.Trainer`` /
``trl.SFTTrainer`` (``trainer.factory`` or ``trainer.command``, probes.step.source) built inside
the torchrun process, so its accelerator joins the process group and shards its data.

- **plans**: this rank's micro-batches as the trainer's own ``get_train_dataloader`` yields them
  under the process group (its sampler, its collator, accelerate's ``DataLoaderShard``): random
  is the trainer's own sampler, length_grouped the drop-in ``probes.sampler.LengthGroupedSampler``
  at the recommended bucket size in its ``_get_train_sampler``; chunked into optimizer steps of
  ``gradient_accumulation_steps``, ``num_items_in_batch`` from its ``get_batch_samples``.
- **wrap**: its ``_prepare_for_training`` (the accelerator's DDP, or FSDP2 from
  ``fsdp_config``; on CPU ranks probes.dp.sharding.lift_cpu_gate lets accelerate's FSDP2 run).
- **step**: its ``training_step`` under its accelerator's ``no_sync`` on all but the last
  micro-batch; clipping at ``max_grad_norm``, ``optimizer.step()``, ``lr_scheduler.step()``,
  ``model.zero_grad()`` (transformers.Trainer._run_epoch).

On CPU each micro-batch is cut to ``data_parallel.cpu.max_seq_len`` tokens (every per-token
tensor's prefix), as the harness's lengths are capped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from probes.dp.sharding import DDP, lift_cpu_gate, training_arguments
from probes.dp.worker import DTYPES, RankStep, timed_allreduce_hook
from probes.step.trainer import optimizer_step, trainer_identity

LENGTH_GROUPED = "length_grouped"  # probes.contracts.LENGTH_GROUPED (contracts imports pandas)


def cut(batch: dict[str, Any], cap: int | None) -> dict[str, Any]:
    """A collated micro-batch with every per-token tensor cut to its first ``cap`` positions."""
    ids = batch.get("input_ids")
    if not cap or ids is None or ids.dim() < 2 or ids.shape[1] <= cap:
        return batch
    length = ids.shape[1]
    return {
        k: v[:, :cap] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == length else v
        for k, v in batch.items()
    }


def token_counts(batch: dict[str, Any]) -> tuple[int, int]:
    """(padded, real) tokens of a collated micro-batch (real: its attention mask's ones)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    return int(ids.numel()), int(mask.sum()) if mask is not None else int(ids.numel())


class TrainerRank:
    """probes.dp.worker.Rank for the user's trainer."""

    def __init__(self, job: dict[str, Any], trainer: Any, source: Any, world: int) -> None:
        self.job, self.trainer, self.source, self.world = job, trainer, source, world
        self.lifted = lift_cpu_gate(trainer)
        self.sharding = job["trainer"]["sharding"]
        self.model: Any = trainer.model  # the wrapped model once wrap() ran
        self.hook = False

    @classmethod
    def build(cls, job: dict[str, Any], rank: int, world: int, device: torch.device):
        from probes.step.source import output_dir, trainer_source
        from probes.step.trainer import probe_settings

        spec = job["trainer"]
        sharded = training_arguments(spec["sharding"], spec.get("fsdp_config"))
        settings = probe_settings(
            output_dir(), device, DTYPES[job["dtype"]], None, int(job["seed"]), sharded
        )
        source = trainer_source(spec["section"])
        return cls(job, source.build(settings), source, world)

    # the plans ------------------------------------------------------------------------------
    def loader(self, strategy: str) -> Any:
        """The trainer's own train dataloader under the process group, its sampler the
        strategy's (the trainer's own for random; the drop-in length-grouped sampler)."""
        from probes.sampler import LengthGroupedSampler, dataset_lengths

        trainer, args = self.trainer, self.trainer.args
        vars(trainer).pop("_get_train_sampler", None)
        if strategy == LENGTH_GROUPED:
            seed = args.data_seed if args.data_seed is not None else args.seed

            def sampler(train_dataset: Any = None) -> LengthGroupedSampler:
                dataset = trainer.train_dataset if train_dataset is None else train_dataset
                return LengthGroupedSampler(
                    dataset_lengths(dataset, args.length_column_name),
                    micro_batch_size=args.train_batch_size,
                    bucket_size_batches=int(self.job["trainer"]["bucket_size_batches"]),
                    seed=seed,
                )

            trainer._get_train_sampler = sampler
        try:
            return trainer.get_train_dataloader()
        finally:
            vars(trainer).pop("_get_train_sampler", None)

    def plans(self) -> list[RankStep]:
        spec, steps = self.job["trainer"], []
        for strategy in spec["strategies"]:
            for index, micro in self.sampled(strategy).items():
                batches, items = self.trainer.get_batch_samples(
                    iter(micro), len(micro), self.trainer.args.device
                )
                counts = [token_counts(b) for b in batches]
                steps.append(
                    RankStep(
                        strategy,
                        index,
                        batches,
                        sum(c[0] for c in counts),
                        sum(c[1] for c in counts),
                        {"num_items_in_batch": items},
                    )
                )
        return steps

    def sampled(self, strategy: str) -> dict[int, list[Any]]:
        """The sampled optimizer steps' micro-batches of this rank's epoch (each cut on CPU);
        only those are kept, and the epoch is read up to the last of them."""
        from probes.dp.shard import sample_steps

        spec = self.job["trainer"]
        loader = self.loader(strategy)
        accum = int(self.trainer.args.gradient_accumulation_steps)
        total = self.common(-(-len(loader) // accum))
        wanted = set(sample_steps(total, int(spec["n_steps"])))
        kept: dict[int, list[Any]] = {index: [] for index in sorted(wanted)}
        for position, batch in enumerate(loader):
            index = position // accum
            if index > max(wanted, default=-1):
                break
            if index in wanted:
                kept[index].append(cut(batch, spec.get("cap")))
        return kept

    def common(self, n_steps: int) -> int:
        """Steps every rank has (equal under accelerate's even_batches; the minimum guards a
        ragged tail, so every rank samples the same steps)."""
        import torch.distributed as dist

        count = torch.tensor([n_steps], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    # the step -------------------------------------------------------------------------------
    def training_step(self, step: RankStep, batch: Any) -> None:
        """The trainer's ``training_step``; a failure names the trainer and its own line."""
        from probes.step.trainer import TrainerStep

        items = step.extra.get("num_items_in_batch")
        TrainerStep.named(
            self, "training_step", self.trainer.training_step, self.model, batch, items
        )

    def local(self, step: RankStep) -> None:
        for batch in step.batches:
            self.training_step(step, batch)

    def clear(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def wrap(self, record: dict[str, float], sync: Callable[[], None]) -> bool:
        from probes.step.trainer import SCHEDULE_STEPS

        self.model, _ = self.trainer._prepare_for_training(SCHEDULE_STEPS, None, None)
        self.model.train()
        if self.sharding == DDP and hasattr(self.model, "register_comm_hook"):
            self.model.register_comm_hook(None, timed_allreduce_hook(record, self.world, sync))
            self.hook = True
        return self.hook

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # the loop's flag: an AcceleratedOptimizer steps only when gradients were synced
        self.trainer.accelerator.gradient_state._set_sync_gradients(last)
        if last:
            return contextlib.nullcontext()
        return self.trainer.accelerator.no_sync(model=self.model)

    def forward_backward(self, step: RankStep, batch: Any) -> None:
        self.training_step(step, batch)

    def optimizer_step(self) -> None:
        optimizer_step(self.trainer, self.model)

    def describe(self) -> dict[str, Any]:
        args = self.trainer.args
        return {
            **trainer_identity(self.trainer, self.trainer.data_collator, self.source),
            "sharding": self.sharding,
            "settings": {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "max_grad_norm": args.max_grad_norm,
                "train_sampling_strategy": str(getattr(args, "train_sampling_strategy", "")),
            },
        }

    def wrapped(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sharding": self.sharding, "wrapper": type(self.model).__name__}
        if self.hook:
            out["ddp"] = {
                "broadcast_buffers": bool(self.model.broadcast_buffers),
                "bucket_cap_mb": self.model.bucket_bytes_cap / 2**20,
                "comm_hook": "timed all-reduce",
            }
        if self.trainer.is_fsdp_enabled:
            plugin = self.trainer.args.fsdp_plugin_args or {}
            out["fsdp"] = {
                **{k: v for k, v in plugin.items() if isinstance(v, str | int | bool)},
                "cpu_gate_lifted": self.lifted,
            }
        return out
