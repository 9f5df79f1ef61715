"""One training step as the user's own ``transformers.Trainer`` / ``trl.SFTTrainer`` takes it.

The trainer is built by the user's factory or command (probes.step.source). A micro-batch is the
trainer's own collator over rows of its own prepared train dataset (never a second tokenization),
run through ``trainer.training_step`` (its ``_prepare_inputs``, ``compute_loss`` with whatever the
trainer computes beside the loss, backward through its accelerator). The optimizer step is the
trainer's loop's: gradient clipping at ``max_grad_norm``, ``optimizer.step()``,
``lr_scheduler.step()``, ``model.zero_grad()`` (transformers.Trainer._inner_training_loop).
A packed micro-batch (one flattened row of its documents, position ids restarting per document)
is the collator TRL's ``padding_free`` / transformers' ``DataCollatorWithFlattening`` builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from probes.step.factory import QUIET_SETTINGS, load_factory
from probes.step.runner import StepRunner
from probes.step.source import TrainerSource

IGNORE_INDEX = -100
# steps the scheduler is built for: the probes take a few hundred steps at most, and a schedule
# that reached its end would change nothing the step costs
SCHEDULE_STEPS = 1_000_000


def example_row(example_id: str) -> int:
    """The trainer dataset's row an example id names (the padding stage writes row numbers)."""
    return int(example_id)


def packed_collator(trainer: Any) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The trainer's collator in its padding-free form: TRL's own collator with
    ``padding_free=True`` (what ``SFTConfig(packing=True)`` or ``padding_free=True`` trains
    with), else transformers' ``DataCollatorWithFlattening``."""
    collator = trainer.data_collator
    if dataclasses.is_dataclass(collator) and any(
        f.name == "padding_free" for f in dataclasses.fields(collator)
    ):
        return dataclasses.replace(collator, padding_free=True)
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True)


def loader_inputs(trainer: Any, collator: Callable) -> tuple[Any, Callable]:
    """The dataset and collator the trainer's dataloader uses (Trainer._get_dataloader): the
    columns its model does not take removed from a ``datasets.Dataset``, else from each batch."""
    import datasets

    dataset = trainer.train_dataset
    if isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description="training"), collator
    return dataset, trainer._get_collator_with_removed_columns(collator, description="training")


def rehearsed(row: Mapping[str, Any], cap: int, max_seq_len: int) -> dict[str, Any]:
    """A prepared row at a CPU rehearsal's length (probes.batching.plans.rehearsal_length: its
    length scaled by cap / max_seq_len): every per-token list of the row's length keeps the same
    evenly spaced positions, so the row keeps its share of loss tokens (an assistant turn late in
    a conversation is not cut away as a prefix would cut it)."""
    from probes.batching.plans import rehearsal_length

    n = len(row["input_ids"])
    k = int(rehearsal_length([n], cap, max_seq_len)[0])
    if n <= k:
        return dict(row)
    keep = [(i * n) // k for i in range(k)]
    return {
        key: [v[i] for i in keep] if isinstance(v, list | tuple) and len(v) == n else v
        for key, v in row.items()
    }


def loss_items(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """Tokens that carry loss (labels not ignored): the Trainer's ``num_items_in_batch``."""
    labels = batch.get("labels")
    if labels is None:
        return None
    return (labels[..., 1:] != IGNORE_INDEX).sum()


PACKED_LAYOUT = "packed"  # probes.batching.plans.PACKED (not imported: plans imports pandas)


class KeyedRows:
    """The trainer's rows by (example id, packed) key, for a DataLoader whose batch sampler
    yields the keys of one plan micro-batch at a time."""

    def __init__(self, step: TrainerStep) -> None:
        self.step = step

    def __getitem__(self, key: tuple[str, bool]) -> tuple[dict[str, Any], bool]:
        return self.step.features([key[0]])[0], key[1]

    def __len__(self) -> int:
        return len(self.step.dataset)


def loop_clock_class() -> type:
    from transformers import TrainerCallback

    class LoopClock(TrainerCallback):
        """Marks the phases of the trainer's loop from its own callbacks."""

        def __init__(self, mark: Callable[[str], None]) -> None:
            self.mark = mark

        def on_step_begin(self, args, state, control, **kwargs):
            self.mark("built")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.mark("micro_batch")

        def on_step_end(self, args, state, control, **kwargs):
            self.mark("optimizer")

    return LoopClock


def LoopClock(mark: Callable[[str], None]) -> Any:  # noqa: N802 (a class built on demand)
    return loop_clock_class()(mark)


class TrainerStep:
    """The user's trainer as the probes run it: micro-batches, forward + backward, optimizer."""

    def __init__(
        self,
        trainer: Any,
        source: TrainerSource | None = None,
        rehearsal: tuple[int, int] | None = None,
    ) -> None:
        self.trainer = trainer
        self.source = source
        self.rehearsal = rehearsal  # (cap, max_seq_len) of a CPU rehearsal, else None
        args = trainer.args
        if trainer.optimizer is None or trainer.lr_scheduler is None:
            trainer.create_optimizer_and_scheduler(num_training_steps=SCHEDULE_STEPS)
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.grad_accum = args.gradient_accumulation_steps
        self.model = trainer.model
        self.model.train()
        self.optimizer = trainer.optimizer
        self.device = args.device
        self.dataset, self.collator = loader_inputs(trainer, trainer.data_collator)
        _, self.flat_collator = loader_inputs(trainer, packed_collator(trainer))
        self.harness = None  # the trainer path has no harness module

    # the micro-batch -----------------------------------------------------------------------
    def features(self, example_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The trainer's prepared rows; on a CPU rehearsal each at its rehearsal length
        (rehearsed; the trainer is built at its own max_length so its rows and their numbers
        stay those the padding stage counted)."""
        rows = [self.dataset[example_row(i)] for i in example_ids]
        if self.rehearsal is None:
            return rows
        return [rehearsed(row, *self.rehearsal) for row in rows]

    @property
    def collates_in_loop(self) -> bool:
        """Whether the trainer's loop fetches and collates each micro-batch in its own process
        (no dataloader workers): then that is part of a micro-batch's time."""
        return not self.trainer.args.dataloader_num_workers

    def collate(self, example_ids: Sequence[str], packed: bool) -> dict[str, Any]:
        collate = self.flat_collator if packed else self.collator
        return self.named("collator", collate, self.features(example_ids))

    def named(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` with a failure named: the trainer, what raised, its own line (an
        out-of-memory error passes unchanged: the timers record it)."""
        from probes.step.factory import FACTORY_KEY, FactoryError, own_line
        from probes.step.timing import is_out_of_memory

        try:
            return fn(*args)
        except Exception as error:
            if is_out_of_memory(error) or isinstance(error, FactoryError):
                raise
            key = self.source.key if self.source else FACTORY_KEY
            spec = self.source.spec if self.source else "?"
            source = self.source.source_file if self.source else ""
            raise FactoryError(
                f"{key} '{spec}': the {type(self.trainer).__name__}'s {what} raised "
                f"{type(error).__name__}: {error}{own_line(error, source)}. Fix the trainer "
                f"{key} builds (one training step of it reproduces this)."
            ) from error

    def plan_batch(
        self, row: Any, vocab_size: int = 0, generator: Any = None, pad_id: int = 0
    ) -> dict[str, Any]:
        """A plan row's micro-batch: the trainer's collator over its own rows (the row's example
        ids); ``training_step`` moves it to the device, as the trainer's loop does."""
        from probes.batching.plans import PACKED

        return self.collate([str(i) for i in row.example_ids], row.layout == PACKED)

    # the step --------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any]) -> torch.Tensor:
        """``training_step`` and what the trainer's loop does after it for every micro-batch:
        the NaN/inf check of ``logging_nan_inf_filter`` (a host sync on a GPU) and
        ``floating_point_ops`` (transformers.Trainer._inner_training_loop)."""
        trainer = self.trainer
        loss = self.named(
            "training_step", trainer.training_step, self.model, batch, loss_items(batch)
        )
        if trainer.args.logging_nan_inf_filter:
            bool(torch.isnan(loss) or torch.isinf(loss))
        trainer.current_flos += float(trainer.floating_point_ops(batch))
        return loss

    def zero_grad(self) -> None:
        """Drop partial gradients (a step cut short by an out-of-memory error)."""
        self.model.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        optimizer_step(self.trainer, self.model)

    # the same step and timing as the harness's runner: the same calls on this step's methods
    step = StepRunner.step
    timed = StepRunner.timed

    def run_rows(self, rows: Sequence[Any], mark: Callable[[str], None]) -> None:
        """One optimizer step of plan rows through ``trainer.train()`` itself: its dataloader
        yields exactly these micro-batches (the trainer's collator over its rows), its loop
        fetches them, runs ``training_step`` on each, clips, steps the optimizer and the
        scheduler, zeroes the gradients and calls its callbacks. `mark` gets "start" at the
        first fetch, "built" when the loop begins the step (every micro-batch fetched),
        "micro_batch" before the optimizer step and "optimizer" at the step's end."""
        from torch.utils.data import DataLoader

        trainer, args = self.trainer, self.trainer.args
        keys = [[(str(i), row.layout == PACKED_LAYOUT) for i in row.example_ids] for row in rows]
        loader = DataLoader(
            KeyedRows(self), batch_sampler=keys, collate_fn=self.collate_keyed(mark)
        )
        clock = LoopClock(mark)
        trainer.get_train_dataloader = lambda: loader
        args.max_steps = 1
        args.gradient_accumulation_steps = len(rows)
        trainer.add_callback(clock)
        try:
            self.named("train()", trainer.train)
        finally:
            trainer.remove_callback(clock)
            args.gradient_accumulation_steps = self.grad_accum

    def collate_keyed(self, mark: Callable[[str], None]) -> Callable:
        first = [True]

        def collate(features: list[tuple[dict[str, Any], bool]]) -> dict[str, Any]:
            if first[0]:
                mark("start")
                first[0] = False
            packed = features[0][1]
            return (self.flat_collator if packed else self.collator)([f for f, _ in features])

        return collate

    def describe(self) -> dict[str, Any]:
        from probes.step.changes import checkpointing_field

        args = self.trainer.args
        return {
            **trainer_identity(self.trainer, self.collator, self.source),
            "settings": {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "max_length": getattr(args, "max_length", None),
                # the installed name (transformers 5 deprecates gradient_checkpointing)
                checkpointing_field(): getattr(args, checkpointing_field()),
                "max_grad_norm": args.max_grad_norm,
                "optim": str(
                    getattr(args.optim, "value", args.optim)
                ),  # the enum's name users write
            },
            "train_rows": len(self.dataset),
            "rows_rehearsed_at": (
                {"cap": self.rehearsal[0], "max_seq_len": self.rehearsal[1]}
                if self.rehearsal
                else None
            ),
        }


def optimizer_step(trainer: Any, model: Any) -> None:
    """What the trainer's loop does at an optimizer step: clip to max_grad_norm (its own
    _clip_grad_norm), step its optimizer and scheduler, zero the gradients."""
    args = trainer.args
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        trainer._clip_grad_norm(model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()


def trainer_identity(trainer: Any, collator: Any, source: Any) -> dict[str, Any]:
    """What a timed trainer step is, for the outputs' provenance: its class, collator and what
    it was built from ("factory" or "command", probes.step.source)."""
    return {
        "kind": "trainer",
        "trainer": type(trainer).__name__,
        "trainer_module": type(trainer).__module__,
        "collator": type(collator).__name__,
        **({source.kind: source.describe()} if source else {"factory": None}),
    }


def probe_settings(
    output_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    max_length: int | None,
    seed: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings every probe passes to the factory: quiet (nothing written where the user's
    runs write), the device, the dtype, a max_length where one is set, and a change's own."""
    settings: dict[str, Any] = {
        **QUIET_SETTINGS,
        "output_dir": output_dir,
        "use_cpu": device.type != "cuda",
        "seed": seed,
        "dtype": dtype,
    }
    if max_length is not None:
        settings["max_length"] = int(max_length)
    settings.update(extra or {})
    return settings


def load_trainer_step(
    source: TrainerSource | str,
    settings: Mapping[str, Any],
    rehearsal: tuple[int, int] | None = None,
) -> TrainerStep:
    """The user's trainer, built once with `settings` by its source (a factory spec string is
    a ``trainer.factory``), as a TrainerStep (rows at a CPU rehearsal's (cap, max_seq_len))."""
    if isinstance(source, str):
        source = load_factory(source)
    return TrainerStep(source.build(settings), source, rehearsal)
