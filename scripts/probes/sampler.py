"""A drop-in sampler for the bucket size the sweep recommends.

``LengthGroupedSampler`` yields exactly the ordering the bucket sweep measured for a bucket size
(``orders.length_grouped_order`` on ``orders.seeded_permutation(n, seed + epoch)``): shuffle,
cut into buckets of ``bucket_size_batches × micro_batch_size`` examples, sort each bucket by length
(descending), longest bucket head first. Batch its indices ``micro_batch_size`` at a time.

Plain PyTorch::

    sampler = LengthGroupedSampler(lengths, micro_batch_size=2, bucket_size_batches=8, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=pad_to_longest)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...

Hugging Face Trainer (or TRL's SFTTrainer, a Trainer subclass): the Trainer asks
``_get_train_sampler(self, train_dataset=None)`` for its sampler (transformers 5.x signature;
4.x has no ``train_dataset`` argument, which the override accepts either way) and calls
``set_epoch`` on it every epoch::

    Trainer = length_grouped_trainer(transformers.Trainer)
    trainer = Trainer(model=..., args=args, train_dataset=ds, bucket_size_batches=8)

The Trainer's micro-batch is ``args.train_batch_size``; the lengths are read from the Trainer's
own (already tokenised) training dataset: its ``args.length_column_name`` column when present,
else the length of each example's ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.utils.data

from probes.batching import orders


class LengthGroupedSampler(torch.utils.data.Sampler[int]):
    """Length-grouped example order with a chosen bucket size; seedable, epoch-aware.

    Args:
        lengths: token length of every example, in dataset order.
        micro_batch_size: examples per micro-batch (the DataLoader's ``batch_size``).
        bucket_size_batches: micro-batches per bucket (1 = random batches; ≥ n / micro = a global
            sort), the sweep's ``bucket_size_batches``.
        seed: shuffle seed; epoch e shuffles with ``seed + e`` (as HF's distributed samplers do).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        micro_batch_size: int,
        bucket_size_batches: int,
        seed: int = 0,
    ) -> None:
        array = np.asarray(lengths)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(
                f"lengths must be a non-empty 1-D sequence of token counts, got shape {array.shape}"
            )
        if not np.issubdtype(array.dtype, np.integer):
            if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
                raise ValueError("lengths must be whole token counts")
        array = array.astype(np.int64)
        if array.min() < 1:
            first = int(np.flatnonzero(array < 1)[0])
            raise ValueError(
                f"lengths[{first}] = {int(array[first])}: every example needs at least one token "
                "(drop empty examples before batching)"
            )
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("bucket_size_batches", bucket_size_batches),
        ):
            if int(value) != value or int(value) < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.lengths = array
        self.micro_batch_size = int(micro_batch_size)
        self.bucket_size_batches = int(bucket_size_batches)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for this epoch (seed + epoch); the Trainer calls it each epoch."""
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The example order of one epoch (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        perm = orders.seeded_permutation(self.lengths.size, self.seed + epoch)
        return orders.length_grouped_order(
            self.lengths, perm, self.micro_batch_size, self.bucket_size_batches
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return int(self.lengths.size)


def dataset_lengths(dataset: Any, length_column: str = "length") -> list[int]:
    """Token lengths of a tokenised dataset: its ``length_column`` if it has one, else
    ``len(example["input_ids"])`` per example (a ``datasets.Dataset`` or any indexable dataset)."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        if length_column in columns:
            return [int(x) for x in dataset[length_column]]
        if "input_ids" in columns:
            return [len(x) for x in dataset["input_ids"]]
    lengths = []
    for index in range(len(dataset)):
        example = dataset[index]
        if not isinstance(example, dict) or "input_ids" not in example:
            raise ValueError(
                f"dataset example {index} has no 'input_ids' (and the dataset no "
                f"'{length_column}' column): cannot tell its length; pass a tokenised dataset"
            )
        lengths.append(len(example["input_ids"]))
    return lengths


TrainerT = TypeVar("TrainerT")


def length_grouped_trainer(trainer_class: type[TrainerT]) -> type[TrainerT]:
    """A subclass of ``trainer_class`` (transformers.Trainer, trl.SFTTrainer, ...) that trains with
    ``LengthGroupedSampler`` at ``bucket_size_batches`` (a keyword of its constructor).

    The sampler's seed is ``args.data_seed`` if set, else ``args.seed``; the micro-batch is
    ``args.train_batch_size``. Evaluation samplers are untouched.
    """

    class LengthGroupedTrainer(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, bucket_size_batches: int, **kwargs: Any) -> None:
            if int(bucket_size_batches) < 1:
                raise ValueError(f"bucket_size_batches must be ≥ 1, got {bucket_size_batches}")
            self.bucket_size_batches = int(bucket_size_batches)
            super().__init__(*args, **kwargs)

        def _get_train_sampler(self, train_dataset: Any = None) -> LengthGroupedSampler:
            dataset = self.train_dataset if train_dataset is None else train_dataset
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return LengthGroupedSampler(
                dataset_lengths(dataset, self.args.length_column_name),
                micro_batch_size=self.args.train_batch_size,
                bucket_size_batches=self.bucket_size_batches,
                seed=seed,
            )

    LengthGroupedTrainer.__name__ = f"LengthGrouped{trainer_class.__name__}"
    LengthGroupedTrainer.__qualname__ = LengthGroupedTrainer.__name__
    return LengthGroupedTrainer


def trainer_group_by_length_permutation(n: int, seed: int) -> np.ndarray:
    """The shuffle ``TrainingArguments(train_sampling_strategy="group_by_length", seed=seed)``
    gives the Trainer's first epoch on one process with ``dataloader_num_workers=0``.

    transformers' LengthGroupedSampler gets no generator from the Trainer, so it shuffles with the
    global torch RNG, which ``Trainer.__init__`` seeds with ``set_seed(args.seed)``; before the
    sampler runs, ``iter(DataLoader)`` draws its workers' base seed (one int64) from that same
    RNG (torch/utils/data/dataloader.py, ``_BaseDataLoaderIter.__init__``). Anything else that
    draws from the global RNG in between (a model built after the Trainer, user callbacks)
    shifts it again: the drop-in sampler, with its own generator, has no such dependence.
    """
    generator = torch.Generator().manual_seed(int(seed))
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return torch.randperm(int(n), generator=generator).numpy().astype(np.int64)
