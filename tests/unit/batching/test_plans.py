"""Batch plans: every strategy's micro-batches from the bucket stage's own orders (ids only)."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from probes.batching import orders, rebalance
from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.bucket import sweep as bucket
from probes.contracts import TRAINER_DATASET_FILE, TRAINING_STATUSES
from probes.io import read_provenance, write_parquet
from probes.lengths import LengthSet
from probes.step import fit

MICRO, ACCUM, MAX_LEN = 2, 4, 256


def _examples(n=301, seed=0) -> pl.PlanExamples:
    frame = bucket_controls.synthetic_lengths_frame(n, seed=seed, max_seq_len=MAX_LEN)
    used = frame[frame["status"].isin(TRAINING_STATUSES)]
    lengths = used["n_tokens"].to_numpy(np.int64)
    loss = np.where(np.arange(lengths.size) % 3 == 0, 0, lengths // 2)  # a third carry no loss
    return pl.PlanExamples(used["example_id"].to_numpy(object), lengths, loss)


@pytest.fixture(scope="module")
def examples() -> pl.PlanExamples:
    return _examples()


@pytest.fixture(scope="module")
def plans(examples) -> pd.DataFrame:
    return pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, bucket_size_batches=8, seed=0)


def _ids(plan: pd.DataFrame) -> list[str]:
    return [i for ids in plan["example_ids"] for i in ids]


def test_every_strategy_and_column(plans):
    assert set(plans["strategy"]) == set(pl.STRATEGIES)
    assert list(plans.columns) == list(pl.PLAN_COLUMNS)
    padded = plans[plans["strategy"] != pl.PACKING]
    assert (padded["optimizer_step_index"] == padded["micro_batch_index"] // ACCUM).all()


def test_packing_is_planned_at_the_shape_its_change_pastes(plans, examples):
    """The packed plan's rows per micro-batch and grad_accum are the settings recommendations.json
    emits for packing (one rule: packing.packed_batch_shape), tokens per update kept."""
    from probes.apply.changes import Baseline
    from probes.apply.packing import packing_plan
    from probes.batching import packing

    n_rows = packing.pack(examples.lengths, MAX_LEN).n_rows
    lengths = examples.lengths
    base = Baseline(MICRO, ACCUM, MAX_LEN, lengths.size, int(lengths.sum()), int(lengths.max()))
    pasted = packing_plan(base, n_rows)
    packed = plans[plans["strategy"] == pl.PACKING]
    rows, accum = pasted["per_device_train_batch_size"], pasted["gradient_accumulation_steps"]
    assert packed["rows"].iloc[:-1].eq(rows).all() and packed["rows"].max() == rows
    assert (packed["optimizer_step_index"] == packed["micro_batch_index"] // accum).all()
    per_update = packed.groupby("optimizer_step_index")["real_tokens"].sum().iloc[:-1].mean()
    base_update = MICRO * ACCUM * lengths.mean()
    assert abs(per_update / base_update - 1) < 0.5 / rows / accum + 0.25


def test_each_strategy_trains_each_example_once(plans, examples):
    everyone = sorted(examples.example_ids)
    for name in (pl.RANDOM, pl.LENGTH_GROUPED, pl.GLOBAL_SORT, pl.PACKING, pl.PAD_TO_MAX):
        assert sorted(_ids(plans[plans["strategy"] == name])) == everyone, name
    with_loss = sorted(examples.example_ids[examples.loss_tokens > 0])
    assert len(with_loss) < len(everyone)  # the fixture has examples without a loss token
    assert sorted(_ids(plans[plans["strategy"] == pl.RANDOM_NO_IDLE])) == with_loss


def test_no_random_no_idle_plan_where_every_example_carries_loss(examples):
    """A trainer that drops fully masked examples itself (TRL does) leaves nothing to filter:
    the plan would be random's micro-batch for micro-batch, so it is not built (nor timed)."""
    every = dataclasses.replace(examples, loss_tokens=np.maximum(examples.loss_tokens, 1))
    built = pl.build_plans(every, MICRO, ACCUM, MAX_LEN, bucket_size_batches=4)
    assert pl.RANDOM_NO_IDLE not in set(built["strategy"])
    assert pl.RANDOM in set(built["strategy"])


def test_no_pad_to_max_plan_for_a_users_trainer(tmp_path, examples):
    """Rows of a trainer's own dataset are collated by its collator, which the padding stage
    checked pads each row to its own length: padding to max_seq_len is not that run's setup, so
    its plan (and its conditional advice) is left out; the flag survives the CPU cap."""
    frame = bucket_controls.synthetic_lengths_frame(120, seed=4, max_seq_len=MAX_LEN)
    for file, collated in (("data.jsonl", False), (TRAINER_DATASET_FILE, True)):
        path = tmp_path / "lengths.parquet"
        write_parquet(frame.assign(file=file), path, {})
        read = pl.read_examples(path, MAX_LEN)
        assert read.trainer_collated is collated
        assert pl.rehearsal_examples(read, 64, MAX_LEN).trainer_collated is collated
    trainer = dataclasses.replace(examples, trainer_collated=True)
    built = set(pl.build_plans(trainer, MICRO, ACCUM, MAX_LEN, bucket_size_batches=4)["strategy"])
    assert built == set(pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, 4)["strategy"]) - {
        pl.PAD_TO_MAX
    }


def test_padded_shapes_are_the_real_ones(plans):
    padded = plans[plans["layout"] == pl.PADDED]
    longest = padded["example_lengths"].map(max)
    pad_max = padded["strategy"] == pl.PAD_TO_MAX
    assert (padded.loc[~pad_max, "padded_length"] == longest[~pad_max]).all()
    assert (padded.loc[pad_max, "padded_length"] == MAX_LEN).all()
    assert (padded["computed_tokens"] == padded["rows"] * padded["padded_length"]).all()
    assert (padded["real_tokens"] == padded["example_lengths"].map(sum)).all()
    assert (padded["loss_tokens"] == padded["example_loss_tokens"].map(sum)).all()


def test_orders_are_the_bucket_stages(plans, examples):
    perm = orders.seeded_permutation(examples.lengths.size, 0)
    order = orders.length_grouped_order(examples.lengths, perm, MICRO, 8)
    grouped = plans[plans["strategy"] == pl.LENGTH_GROUPED]
    assert _ids(grouped) == list(examples.example_ids[order])


def test_padded_tokens_match_the_bucket_sweep(plans, examples):
    data = LengthSet(examples.lengths, np.zeros(examples.lengths.size, np.int32), ("a",))
    sweep = bucket.sweep_bucket_sizes(data, MICRO, ACCUM, MAX_LEN, [0], [8], packing=["bfd"])
    by_name = sweep.groupby("strategy")["padded_tokens"].first()
    total = plans.groupby("strategy")["computed_tokens"].sum()
    assert total[pl.RANDOM] == by_name["random"]
    assert total[pl.GLOBAL_SORT] == by_name["global_sort"]
    assert total[pl.LENGTH_GROUPED] == by_name["length_grouped"]
    packed = plans[plans["strategy"] == pl.PACKING]
    assert packed["rows"].sum() == sweep.loc[sweep["strategy"] == "packing_bfd", "n_bins"].iloc[0]
    assert total[pl.GLOBAL_SORT] <= total[pl.LENGTH_GROUPED] <= total[pl.RANDOM]


def test_packed_rows_fit_and_keep_documents_apart(plans):
    packed = plans[plans["strategy"] == pl.PACKING]
    assert (packed["layout"] == pl.PACKED).all()
    assert (packed["rows"] >= 1).all()
    for row in packed.itertuples():
        counts = list(row.documents_per_row)
        assert sum(counts) == row.n_examples == len(row.example_lengths)
        bounds = np.cumsum([0, *counts])
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            assert sum(row.example_lengths[start:end]) <= MAX_LEN
        assert row.computed_tokens == row.real_tokens == sum(row.example_lengths)


def test_packed_rows_are_trls_rows_shuffled(plans, examples):
    """Each packed micro-batch takes TRL's rows (documents in TRL's order) in the seed's order."""
    from probes.batching import packing

    rows = packing.pack(examples.lengths, MAX_LEN)
    row_order = orders.seeded_permutation(rows.n_rows, 0)
    expected = [examples.example_ids[rows.row(int(r))].tolist() for r in row_order]
    packed = plans[plans["strategy"] == pl.PACKING]
    got = []
    for row in packed.itertuples():
        bounds = np.cumsum([0, *row.documents_per_row])
        got += [list(row.example_ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert got == expected
    given = pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, 8, seed=0, packed=rows)
    pd.testing.assert_frame_equal(given, plans)


def test_summary_and_tokens_per_update(plans):
    summary = pl.plan_summary(plans).set_index("strategy")
    assert summary.loc[pl.RANDOM, "optimizer_steps"] == -(
        -summary.loc[pl.RANDOM, "micro_batches"] // ACCUM
    )
    assert summary.loc[pl.PACKING, "micro_batches"] < summary.loc[pl.RANDOM, "micro_batches"]
    packed = summary.loc[pl.PACKING, "real_tokens_per_micro_batch"]
    base = summary.loc[pl.RANDOM, "real_tokens_per_micro_batch"]
    assert pl.grad_accum_for_same_tokens(packed, base, ACCUM) == max(
        1, round(ACCUM * base / packed)
    )
    assert pl.grad_accum_for_same_tokens(base, base, ACCUM) == ACCUM


def test_plans_are_deterministic_and_seeded(examples, plans):
    again = pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, 8, seed=0)
    pd.testing.assert_frame_equal(plans, again)
    other = pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, 8, seed=1)
    assert _ids(other[other["strategy"] == pl.RANDOM]) != _ids(
        plans[plans["strategy"] == pl.RANDOM]
    )


needs_rebalance = pytest.mark.skipif(
    rebalance.unavailable_reason() is not None, reason=str(rebalance.unavailable_reason())
)


@needs_rebalance
def test_the_batch_rebalance_plan_is_transformers_sampler_as_the_trainer_builds_it(examples):
    """The sampler the Trainer builds (no seed passed: the class default), whatever the plan's
    seed; micro-batches of varying rows, the Trainer's optimizer steps; a tail smaller than
    grad_accum is filled with repeated examples, as the sampler does."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    for n in (301, 10):  # 10: a last step of 2 examples for 4 micro-batches
        few = _examples(n) if n != 301 else examples
        theirs = BatchRebalanceSampler(
            few.lengths.tolist(), MICRO * ACCUM, dp_size=1, grad_accum=ACCUM, drop_last=False
        )
        expected = [[str(few.example_ids[i]) for i in batch] for batch in theirs]
        for seed in (0, 1):
            built = pl.build_plans(few, MICRO, ACCUM, MAX_LEN, 8, seed=seed)
            plan = built[built["strategy"] == pl.BATCH_REBALANCE].sort_values("micro_batch_index")
            assert [list(ids) for ids in plan["example_ids"]] == expected
        steps = pl.plan_summary(built).set_index("strategy")["optimizer_steps"]
        assert steps[pl.BATCH_REBALANCE] == steps[pl.RANDOM] == -(-len(few.lengths) // 8)
        fed = _ids(plan)
        assert set(fed) == set(few.example_ids) and len(fed) - len(few.lengths) < ACCUM
    assert len(fed) == 12 and plan["rows"].max() > MICRO


@needs_rebalance
def test_the_memory_stage_sees_batch_rebalances_largest_micro_batch(plans):
    """Its largest micro-batch holds more rows than micro_batch_size: the memory stage's
    largest micro-batch over each whole plan includes it."""
    from probes.memory.shapes import largest_micro_batches

    plan = plans[plans["strategy"] == pl.BATCH_REBALANCE]
    shape = largest_micro_batches(plans)[pl.BATCH_REBALANCE]
    assert shape.rows * shape.length == plan["computed_tokens"].max()
    assert plan["rows"].max() > MICRO


def test_no_batch_rebalance_plan_with_fewer_examples_than_grad_accum():
    few = _examples(3)
    built = pl.build_plans(few, MICRO, len(few.lengths) + 1, MAX_LEN, 8, seed=0)
    assert pl.BATCH_REBALANCE not in set(built["strategy"])
    assert pl.RANDOM in set(built["strategy"])


def test_read_examples_skips_empty_and_error(tmp_path):
    frame = bucket_controls.synthetic_lengths_frame(
        200, seed=3, max_seq_len=MAX_LEN, empty_share=0.1
    )
    path = tmp_path / "lengths.parquet"
    write_parquet(frame, path, {})
    examples = pl.read_examples(path, MAX_LEN)
    used = frame["status"].isin(TRAINING_STATUSES)
    assert list(examples.example_ids) == list(frame.loc[used, "example_id"])
    assert (examples.loss_tokens <= examples.lengths).all()


def test_bucket_stage_plans_and_read_back(tmp_path):
    from probes.settings import TrainingConfig

    frame = bucket_controls.synthetic_lengths_frame(120, seed=4, max_seq_len=MAX_LEN)
    lengths = tmp_path / "lengths.parquet"
    write_parquet(frame, lengths, {})
    training = TrainingConfig(MICRO, ACCUM, MAX_LEN, "assistant", 1)
    rec = {"recommended": {"bucket_size_batches": 4}}
    out = tmp_path / "plans.parquet"
    write_parquet(pl.bucket_stage_plans(lengths, rec, training, seed=2), out, {"plan_seed": 2})
    back = pl.read_plans(out)
    idle = pl.read_examples(lengths, MAX_LEN).loss_tokens == 0
    expected = set(pl.STRATEGIES) - (set() if idle.any() else {pl.RANDOM_NO_IDLE})
    assert set(back["strategy"]) == expected
    assert read_provenance(out)["plan_seed"] == 2


def test_bad_inputs_name_what_to_do(tmp_path):
    with pytest.raises(pl.PlanInputError, match="bucket_sweep"):
        pl.read_plans(tmp_path / "missing.parquet")
    path = tmp_path / "plans.parquet"
    write_parquet(pd.DataFrame({"strategy": ["random"]}), path, {})
    with pytest.raises(pl.PlanInputError, match="missing column"):
        pl.read_plans(path)
    with pytest.raises(pl.PlanInputError, match="bucket_size_batches"):
        pl.recommended_bucket_size({"status": "ok"})


def test_a_cpu_rehearsal_scales_lengths_and_keeps_the_datas_shape(examples):
    """Scaled, not cut: every length within the rehearsal's cap, loss tokens scaled with it, and
    the plans keep the real data's micro-batch counts and (to rounding) its padding waste, where
    cutting at the cap flattens the lengths so batching saves nothing."""
    small = pl.rehearsal_examples(examples, 64, MAX_LEN)
    assert small.lengths.max() <= 64 and small.lengths.min() >= 1
    assert (small.loss_tokens <= small.lengths).all()
    assert ((small.loss_tokens > 0) == (examples.loss_tokens > 0)).all()
    expected = np.maximum(np.ceil(examples.lengths / 4), np.minimum(examples.lengths, 2))
    assert np.array_equal(small.lengths, expected.astype(int))
    # a row of one token predicts nothing: every example of two tokens or more keeps two
    assert (small.lengths[examples.lengths >= 2] >= 2).all()
    assert (pl.rehearsal_length([1, 2, 3, 64, 65, 4096], 64, 4096) == [1, 2, 2, 2, 2, 64]).all()
    real = pl.plan_summary(pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, 8, seed=0))
    rehearsed = pl.plan_summary(pl.build_plans(small, MICRO, ACCUM, 64, 8, seed=0))
    real, rehearsed = real.set_index("strategy"), rehearsed.set_index("strategy")
    padded = [s for s in real.index if s != pl.PACKING]
    assert (real.loc[padded, "micro_batches"] == rehearsed.loc[padded, "micro_batches"]).all()

    def waste(summary):
        return 1 - summary["real_tokens"] / summary["computed_tokens"]

    assert np.allclose(waste(real)[padded], waste(rehearsed)[padded], atol=0.03)
    assert pl.rehearsal_examples(examples, MAX_LEN, MAX_LEN) is examples


def test_default_fit_lengths_come_from_the_data():
    rng = np.random.default_rng(0)
    padded = np.minimum(rng.lognormal(4.5, 1.2, 3000).astype(int) + 8, 4096)
    lengths = fit.default_fit_lengths(padded, 4096, n_points=5, low_quantile=0.1)
    assert len(set(lengths)) >= 5
    assert lengths[-1] == 4096
    assert lengths[0] == int(round(np.quantile(padded, 0.1)))
    # coinciding quantiles are filled geometrically up to five distinct points
    flat = fit.default_fit_lengths(np.full(100, 64), 512)
    assert len(set(flat)) >= 5 and max(flat) == 512
    # the shortest micro-batch joins, so the measured range covers every plan
    with_min = fit.default_fit_lengths(padded, 4096, shortest=9)
    assert with_min[0] == 9 and with_min[1:] == lengths


def test_default_fit_lengths_when_the_data_crowds_the_cap():
    # The CPU replay caps 18-246-token examples at 64: the p10 of the padded lengths is 61.
    crowded = np.array([61] * 2 + [64] * 18)
    lengths = fit.default_fit_lengths(crowded, 64, n_points=5, low_quantile=0.1)
    assert len(set(lengths)) >= 5 and max(lengths) == 64 and min(lengths) == 8
    # one example of 51 tokens: [51, 64] cannot tell the three terms apart, the range widens
    assert min(fit.default_fit_lengths(np.array([51]), 64)) == 8
    with pytest.raises(fit.FitLengthsError, match=r"replay\.cpu\.max_seq_len"):
        fit.default_fit_lengths(np.full(10, 4), 4, n_points=5)
