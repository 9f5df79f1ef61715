"""probes.sampler.LengthGroupedSampler: the sweep's ordering as a torch Sampler."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from probes.batching import metrics as batch_metrics
from probes.batching import orders
from probes.bucket import control as bucket_controls
from probes.bucket import guard
from probes.sampler import (
    LengthGroupedSampler,
    dataset_lengths,
    length_grouped_trainer,
)


def heavy_lengths(n: int = 600, seed: int = 0) -> np.ndarray:
    full, _ = bucket_controls.synthetic_lengths(n, seed)
    return np.minimum(full, 4096)


@pytest.mark.parametrize(("micro", "bucket_size", "seed"), [(2, 1, 0), (3, 5, 1), (4, 50, 2)])
def test_order_is_hf_get_length_grouped_indices(micro, bucket_size, seed):
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = heavy_lengths()
    sampler = LengthGroupedSampler(lengths, micro, bucket_size, seed=seed)
    theirs = get_length_grouped_indices(
        lengths.tolist(),
        micro,
        mega_batch_mult=bucket_size,
        generator=torch.Generator().manual_seed(seed),
    )
    assert list(sampler) == list(theirs)


def test_order_is_the_sweeps_ordering():
    lengths = heavy_lengths()
    sampler = LengthGroupedSampler(lengths, 2, 8, seed=4)
    expected = orders.length_grouped_order(
        lengths, orders.seeded_permutation(lengths.size, 4), 2, 8
    )
    assert np.array_equal(sampler.order(), expected)
    assert sorted(sampler) == list(range(lengths.size))  # a permutation: every example once
    assert len(sampler) == lengths.size


def test_set_epoch_reshuffles_reproducibly():
    lengths = heavy_lengths()
    sampler = LengthGroupedSampler(lengths, 2, 8, seed=7)
    first = list(sampler)
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    assert second == list(LengthGroupedSampler(lengths, 2, 8, seed=8))  # epoch e = seed + e
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(LengthGroupedSampler(lengths, 2, 8, seed=9)) != first


def test_ends_of_the_sweep_random_and_global_sort():
    lengths = heavy_lengths()
    micro = 4
    perm = orders.seeded_permutation(lengths.size, 3)
    random = LengthGroupedSampler(lengths, micro, 1, seed=3).order()
    assert padded(lengths[random], micro) == guard.reference_random_padded(lengths, perm, micro)
    everything = LengthGroupedSampler(lengths, micro, lengths.size, seed=3).order()
    assert padded(lengths[everything], micro) == guard.reference_sorted_padded(lengths, micro)


def padded(ordered: np.ndarray, micro: int) -> int:
    starts = np.arange(0, ordered.size, micro)
    return int((np.diff(np.r_[starts, ordered.size]) * np.maximum.reduceat(ordered, starts)).sum())


def test_plain_dataloader_feeds_the_predicted_padding():
    lengths = heavy_lengths(203)  # a short last micro-batch
    micro, bucket_size, seed = 4, 6, 2
    sampler = LengthGroupedSampler(lengths, micro, bucket_size, seed=seed)
    loader = torch.utils.data.DataLoader(
        list(range(lengths.size)),
        batch_size=micro,
        sampler=sampler,
        collate_fn=lambda ids: (len(ids), int(lengths[ids].max())),
    )
    shapes = list(loader)
    order = sampler.order()
    predicted = batch_metrics.padded_metrics(
        lengths[order], np.zeros(lengths.size, dtype=np.int32), micro, 1, 1
    )
    assert len(shapes) == predicted["n_micro_batches"]
    assert sum(rows * width for rows, width in shapes) == predicted["padded_tokens"]
    assert shapes[0][1] == lengths.max()  # longest first, as HF (OOM early)


@pytest.mark.parametrize(
    ("lengths", "micro", "bucket_size", "message"),
    [
        ([], 2, 1, "non-empty"),
        ([5, 0, 3], 2, 1, r"lengths\[1\] = 0"),
        ([5, 2.5], 2, 1, "whole token counts"),
        ([5, 3], 0, 1, "micro_batch_size"),
        ([5, 3], 2, -1, "bucket_size_batches"),
    ],
)
def test_bad_arguments_are_named(lengths, micro, bucket_size, message):
    with pytest.raises(ValueError, match=message):
        LengthGroupedSampler(lengths, micro, bucket_size)


def test_trainer_hook_matches_the_installed_signature(tmp_path):
    transformers = pytest.importorskip("transformers")
    hook = inspect.signature(transformers.Trainer._get_train_sampler)
    ours = inspect.signature(length_grouped_trainer(transformers.Trainer)._get_train_sampler)
    assert list(hook.parameters) == list(ours.parameters)


def test_trainer_subclass_builds_the_sampler_from_its_dataset(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    lengths = heavy_lengths(40) % 50 + 1
    dataset = [{"input_ids": [1] * int(n)} for n in lengths]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        seed=5,
        data_seed=6,
        use_cpu=True,
        report_to="none",
    )
    trainer = length_grouped_trainer(transformers.Trainer)(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=dataset,
        bucket_size_batches=4,
    )
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, LengthGroupedSampler)
    assert sampler.micro_batch_size == args.train_batch_size == 3
    assert sampler.seed == 6  # data_seed wins over seed, as for HF's own shuffles
    assert sampler.bucket_size_batches == 4
    assert np.array_equal(sampler.lengths, lengths)
    assert type(trainer).__name__ == "LengthGroupedTrainer"


def test_dataset_lengths_reads_a_length_column_or_input_ids():
    datasets = pytest.importorskip("datasets")
    with_column = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "length": [7, 9]})
    assert dataset_lengths(with_column) == [7, 9]
    without = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    assert dataset_lengths(without) == [2, 1]
    assert dataset_lengths([{"input_ids": [1, 2, 3]}]) == [3]
    with pytest.raises(ValueError, match="example 0 has no 'input_ids'"):
        dataset_lengths([{"text": "x"}])


def test_sft_trainer_subclass_feeds_the_length_grouped_order(tmp_path):
    """The same factory on TRL's SFTTrainer: lengths read from its own tokenised dataset."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from conftest import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path / "tok")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    words = (3, 10, 5, 40, 7, 2, 25, 9, 14, 1)
    dataset = datasets.Dataset.from_dict({"text": [" ".join(["hello"] * n) for n in words]})
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_length=32,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        num_train_epochs=2,
        seed=3,
    )
    trainer = length_grouped_trainer(trl.SFTTrainer)(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        bucket_size_batches=2,
    )
    sampler = trainer._get_train_sampler()
    expected = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    assert sampler.lengths.tolist() == expected  # truncated to max_length, EOS added by TRL
    fed: list[int] = []
    collate = trainer.data_collator

    def recording(features):
        batch = collate(features)
        fed.append(int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = recording
    trainer.train()
    lengths = np.asarray(expected)
    per_epoch = len(fed) // 2
    # The Trainer calls set_epoch: epoch e feeds the order of seed + e.
    for epoch in (0, 1):
        got = sum(fed[epoch * per_epoch : (epoch + 1) * per_epoch])
        assert got == padded(lengths[sampler.order(epoch)], 2)
    assert not np.array_equal(sampler.order(0), sampler.order(1))
