"""batch_rebalance as a sweep row: transformers' own sampler, the sweep's own metrics."""

from __future__ import annotations

import numpy as np
import pytest

from probes.batching import metrics as batch_metrics
from probes.batching import orders, rebalance
from probes.bucket import control as bucket_controls
from probes.bucket import guard
from probes.bucket import sweep as bucket
from probes.lengths import LengthSet, lengths_from_frame

pytestmark = pytest.mark.skipif(
    rebalance.unavailable_reason() is not None, reason=str(rebalance.unavailable_reason())
)


def synthetic(n: int = 1500, seed: int = 0, max_seq_len: int = 2048) -> LengthSet:
    frame = bucket_controls.synthetic_lengths_frame(n, seed=seed, max_seq_len=max_seq_len)
    return lengths_from_frame(frame, max_seq_len)


def test_padded_metrics_with_explicit_rows_equals_the_fixed_path():
    data = synthetic()
    order = orders.length_grouped_order(
        data.lengths, orders.seeded_permutation(data.lengths.size, 0), 4, 8
    )
    fixed = batch_metrics.padded_metrics(
        data.lengths[order], data.sources[order], 4, 2, data.n_sources
    )
    rows = np.diff(np.r_[np.arange(0, order.size, 4), order.size])
    explicit = batch_metrics.padded_metrics(
        data.lengths[order], data.sources[order], 4, 2, data.n_sources, rows_per_micro_batch=rows
    )
    assert explicit.keys() == fixed.keys()
    for key, value in fixed.items():
        assert explicit[key] == pytest.approx(value, rel=1e-12), key


def test_rows_must_cover_the_order():
    lengths = np.array([3, 4, 5])
    with pytest.raises(ValueError, match="rows_per_micro_batch sums to 2"):
        batch_metrics.padded_metrics(
            lengths, np.zeros(3, dtype=np.int32), 2, 1, 1, np.array([1, 1])
        )


def test_micro_batches_come_from_transformers_sampler_with_the_sweeps_shuffle():
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    data = synthetic()
    micro, grad_accum, seed = 2, 4, 3
    batches = rebalance.rebalance_micro_batches(data.lengths, micro, grad_accum, seed)
    theirs = list(
        BatchRebalanceSampler(
            data.lengths.tolist(),
            effective_batch_size=micro * grad_accum,
            dp_size=1,
            grad_accum=grad_accum,
            seed=seed,
            drop_last=False,
        )
    )
    assert batches == [list(b) for b in theirs]
    # Step k holds exactly the examples of the sweep's seed-`seed` shuffle chunk k (paired rows).
    perm = orders.seeded_permutation(data.lengths.size, seed)
    effective = micro * grad_accum
    for step in range(len(batches) // grad_accum):
        fed = sorted(i for b in batches[step * grad_accum : (step + 1) * grad_accum] for i in b)
        assert fed == sorted(perm[step * effective : (step + 1) * effective].tolist())
    # Every example is fed once (the tail here is ≥ grad_accum examples, so nothing repeats).
    order, rows = rebalance.rebalance_order(data.lengths, micro, grad_accum, seed)
    assert sorted(order.tolist()) == list(range(data.lengths.size))
    assert rows.min() >= 1 and rows.max() > micro  # short groups take more rows


def test_sweep_has_a_batch_rebalance_row_per_seed_and_the_guard_still_holds():
    data = synthetic()
    sweep = bucket.sweep_bucket_sizes(data, 2, 8, 2048, [0, 1])
    rows = sweep.loc[sweep["strategy"] == rebalance.STRATEGY]
    assert sorted(rows["seed"]) == [0, 1]
    assert rows["bucket_size_batches"].isna().all()
    assert (rows["token_efficiency"] > 0).all() and (rows["token_efficiency"] <= 1).all()
    random = sweep.loc[sweep["strategy"] == "random"].set_index("seed")
    # Sorting each step's examples before splitting them must beat random batching.
    for _, row in rows.iterrows():
        assert row["padded_tokens"] < random.loc[row["seed"], "padded_tokens"]
        assert row["micro_batch_rows_max"] > 2
    guard.assert_sweep_varies(sweep, data, 2)  # the guard skips the comparison row


def test_recommend_ignores_the_row_as_a_candidate_and_reports_it_beside():
    data = synthetic()
    with_row = bucket.sweep_bucket_sizes(data, 2, 8, 2048, [0, 1])
    without = bucket.sweep_bucket_sizes(data, 2, 8, 2048, [0, 1], batch_rebalance=False)
    a = bucket.recommend(with_row, 0.9, 0.8)
    b = bucket.recommend(without, 0.9, 0.8)
    assert a["recommended"] == b["recommended"]
    assert b["batch_rebalance"] is None
    point = a["batch_rebalance"]
    expected = with_row.loc[with_row["strategy"] == rebalance.STRATEGY, "token_efficiency"].mean()
    assert point["token_efficiency"] == pytest.approx(expected)
    assert 0 < point["diversity_rel_random"] <= 1.5
