"""The bucket sweep's prediction holds on the real transformers.Trainer.

A tiny random-init causal LM (2 layers, CPU) trains one epoch over ~200 heavy-tailed lengths with
(a) the drop-in ``probes.sampler`` at a chosen bucket size, (b) the Trainer's own
``train_sampling_strategy="group_by_length"`` and (c) ``"batch_rebalance"``. A collator that
pads to the longest row records every micro-batch's shape as it is fed; the padded tokens must
match what the sweep's metric function (``batch_metrics.padded_metrics`` on the sweep's ordering)
predicts within 1%, and every micro-batch's shape must be the predicted one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from probes.batching import metrics as batch_metrics
from probes.batching import orders, rebalance
from probes.bucket import control as bucket_controls
from probes.sampler import length_grouped_trainer, trainer_group_by_length_permutation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from trainer_fixtures import RecordingCollator, TokenDataset, tiny_llama  # noqa: E402

N_EXAMPLES = 192
MAX_LEN = 512
MICRO = 4
GRAD_ACCUM = 2
SEED = 11
TOLERANCE = 0.01
TRAINER_REBALANCE_SEED = 42  # BatchRebalanceSampler's default; the Trainer passes none


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine this tiny model trains ~6x faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def real_lengths() -> np.ndarray:
    """A heavy-tailed sample (the sweep's synthetic mixture), capped at MAX_LEN."""
    full, _ = bucket_controls.synthetic_lengths(N_EXAMPLES, seed=5)
    return np.minimum(full, MAX_LEN)


def train_one_epoch(tmp_path: Any, lengths: np.ndarray, **kwargs: Any) -> RecordingCollator:
    bucket_size = kwargs.pop("bucket_size_batches", None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GRAD_ACCUM,
        num_train_epochs=1,
        learning_rate=1e-3,
        seed=SEED,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **kwargs,
    )
    collator = RecordingCollator()
    common = {
        "model": tiny_llama(MAX_LEN),
        "args": args,
        "train_dataset": TokenDataset(lengths),
        "data_collator": collator,
    }
    if bucket_size is None:
        trainer = transformers.Trainer(**common)
    else:
        trainer = length_grouped_trainer(transformers.Trainer)(
            **common, bucket_size_batches=bucket_size
        )
    trainer.train()
    return collator


def predicted(lengths: np.ndarray, bucket_size: int, perm: np.ndarray) -> dict[str, Any]:
    """The sweep's own prediction for this configuration and shuffle."""
    order = orders.length_grouped_order(lengths, perm, MICRO, bucket_size)
    metrics = batch_metrics.padded_metrics(
        lengths[order], np.zeros(lengths.size, dtype=np.int32), MICRO, GRAD_ACCUM, 1
    )
    starts = np.arange(0, lengths.size, MICRO)
    widths = np.maximum.reduceat(lengths[order], starts)
    rows = np.diff(np.r_[starts, lengths.size])
    return {**metrics, "shapes": list(zip(rows.tolist(), widths.tolist(), strict=True))}


def assert_matches(fed: RecordingCollator, prediction: dict[str, Any]) -> None:
    assert len(fed.shapes) == prediction["n_micro_batches"]
    relative = abs(fed.padded_tokens - prediction["padded_tokens"]) / prediction["padded_tokens"]
    assert relative <= TOLERANCE, (fed.padded_tokens, prediction["padded_tokens"])
    # Per micro-batch: every shape the Trainer fed is the one the sweep's ordering implies.
    assert fed.shapes == prediction["shapes"]


def test_drop_in_sampler_feeds_what_the_sweep_predicts(tmp_path):
    lengths = real_lengths()
    bucket_size = 4
    fed = train_one_epoch(tmp_path, lengths, bucket_size_batches=bucket_size)
    perm = orders.seeded_permutation(lengths.size, SEED)
    prediction = predicted(lengths, bucket_size, perm)
    assert_matches(fed, prediction)
    # The bucket size matters here: random batching would feed measurably more padding.
    random = predicted(lengths, 1, perm)
    assert random["padded_tokens"] > 1.05 * prediction["padded_tokens"]


def test_group_by_length_feeds_what_the_sweep_predicts(tmp_path):
    lengths = real_lengths()
    bucket_size = orders.hf_trainer_mega_batch_mult(lengths.size, MICRO, GRAD_ACCUM)
    assert bucket_size == min(N_EXAMPLES // (4 * MICRO * GRAD_ACCUM), 50) * GRAD_ACCUM
    fed = train_one_epoch(tmp_path, lengths, train_sampling_strategy="group_by_length")
    # The Trainer's LengthGroupedSampler shuffles with the global torch RNG (set_seed(args.seed)
    # in Trainer.__init__), after the DataLoader iterator drew its base seed from it.
    perm = trainer_group_by_length_permutation(lengths.size, SEED)
    assert_matches(fed, predicted(lengths, bucket_size, perm))
    # That is not the sweep's seed-SEED shuffle, only one from the same distribution.
    assert not np.array_equal(perm, orders.seeded_permutation(lengths.size, SEED))


def test_batch_rebalance_feeds_what_the_sweep_row_predicts(tmp_path):
    if rebalance.unavailable_reason() is not None:
        pytest.skip(rebalance.unavailable_reason())
    lengths = real_lengths()
    fed = train_one_epoch(tmp_path, lengths, train_sampling_strategy="batch_rebalance")
    # The Trainer passes no seed to BatchRebalanceSampler: the class default, epoch 0.
    order, rows = rebalance.rebalance_order(lengths, MICRO, GRAD_ACCUM, TRAINER_REBALANCE_SEED)
    prediction = batch_metrics.padded_metrics(
        lengths[order],
        np.zeros(order.size, dtype=np.int32),
        MICRO,
        GRAD_ACCUM,
        1,
        rows_per_micro_batch=rows,
    )
    starts = np.r_[0, np.cumsum(rows)[:-1]]
    widths = np.maximum.reduceat(lengths[order], starts)
    assert_matches(
        fed, {**prediction, "shapes": list(zip(rows.tolist(), widths.tolist(), strict=True))}
    )
    assert len(set(rows.tolist())) > 1  # the micro-batch size really varies
