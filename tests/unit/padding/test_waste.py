"""Padding waste, distribution and CE sizing: the pure functions of probes.padding.waste, and its
control (probes.padding.control)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from probes.batching.metrics import batch_slots
from probes.padding.control import brute_force_random_slots, synthetic_control
from probes.padding.data import STATUSES
from probes.padding.waste import (
    GIB,
    STOCK_BYTES_PER_LOGIT,
    ce_chunk_rows,
    ce_shapes,
    distribution_table,
    expected_random_slots,
    liger_chunk_size,
    model_dims,
    next_pow2,
    summary_table,
    waste_rows,
)


def lengths_frame(n_tokens, statuses=None, sources=None, loss=None):
    n = len(n_tokens)
    return pd.DataFrame(
        {
            "example_id": [f"id{i}" for i in range(n)],
            "file": "f.jsonl",
            "row": np.arange(1, n + 1),
            "source": sources or ["a"] * n,
            "status": statuses or ["OK"] * n,
            "reason": "",
            "n_tokens": n_tokens,
            "n_tokens_full": n_tokens,
            "n_loss_tokens": loss if loss is not None else [t // 2 for t in n_tokens],
            "n_turns": 2,
            "n_truncated_tokens": 0,
            "n_loss_tokens_full": loss if loss is not None else [t // 2 for t in n_tokens],
        }
    )


def test_batch_slots_pads_each_batch_to_its_longest_and_keeps_the_partial_batch():
    assert batch_slots(np.array([1, 3, 2, 2, 5]), 2) == 2 * 3 + 2 * 2 + 1 * 5
    assert batch_slots(np.array([1, 3, 2, 2, 5]), 2, power=2) == 2 * 9 + 2 * 4 + 25
    assert batch_slots(np.array([4, 4]), 8) == 8


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
@pytest.mark.parametrize("power", [1, 2])
def test_expected_random_slots_equals_enumeration_of_every_order(batch_size, power):
    lengths = [3, 1, 7, 7, 2, 5]
    exact = brute_force_random_slots(lengths, batch_size, power)
    assert expected_random_slots(np.array(lengths), batch_size, power) == pytest.approx(
        float(exact), rel=1e-12
    )


def test_random_waste_seed_mean_approaches_the_exact_expectation():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 500, size=400)
    rows = {(r["metric"], r["strategy"]): r for r in waste_rows(lengths, 4, 512, range(64))}
    for metric in ("token_waste", "attention_waste"):
        random = rows[(metric, "random")]
        assert random["n_seeds"] == 64 and random["std"] > 0
        assert random["min"] <= random["value"] <= random["max"]
        assert random["value"] == pytest.approx(random["expected"], abs=4 * random["std"])
        # a global sort is the best pad-to-longest can do; pad-to-max the worst
        assert rows[(metric, "sorted")]["value"] < random["expected"]
        assert random["expected"] < rows[(metric, "pad_to_max_seq_len")]["value"]


def test_waste_is_zero_when_every_batch_is_uniform():
    rows = waste_rows(np.array([8, 8, 8, 8]), 2, 8, [0, 1])
    assert all(row["value"] == 0.0 for row in rows)


def test_attention_waste_uses_squared_lengths():
    rows = {(r["metric"], r["strategy"]): r for r in waste_rows(np.array([1, 3]), 2, 4, [0])}
    assert rows[("token_waste", "dataset_order")]["value"] == pytest.approx(1 - 4 / 6)
    assert rows[("attention_waste", "dataset_order")]["value"] == pytest.approx(1 - 10 / 18)
    assert rows[("attention_waste", "pad_to_max_seq_len")]["value"] == pytest.approx(1 - 10 / 32)


def test_summary_has_every_status_even_when_absent_and_waste_skips_unusable_rows():
    frame = lengths_frame([4, 0, 6, 0], statuses=["OK", "EMPTY", "TRUNCATED", "ERROR"])
    frame.loc[2, "n_truncated_tokens"] = 3
    frame.loc[1, "reason"] = "no_content"
    summary = summary_table(frame, 2, 6, [0, 1])
    status = summary[summary["section"] == "status"]
    counts = status[status["metric"] == "count"].set_index("status")["value"].to_dict()
    assert counts == {"OK": 1, "EMPTY": 1, "ERROR": 1, "TRUNCATED": 1}
    assert set(status["status"]) == set(STATUSES)
    lost = status[(status["status"] == "TRUNCATED") & (status["metric"] == "tokens_lost")]
    assert lost["value"].item() == 3
    waste = summary[summary["section"] == "waste"]
    assert (waste["n_examples"] == 2).all()
    reason = summary[summary["section"] == "reason"]
    assert reason[["status", "reason"]].values.tolist() == [["EMPTY", "no_content"]]


def test_distribution_bins_hold_every_example_and_sources_add_up():
    frame = lengths_frame(
        [1, 2, 3, 100, 1000, 5, 0],
        statuses=["OK"] * 6 + ["ERROR"],
        sources=["a", "a", "b", "b", "c", "c", "c"],
    )
    dist = distribution_table(frame, n_bins=10, max_sources=2)
    stats = dist[(dist["kind"] == "stat") & (dist["measure"] == "n_tokens")]
    count = stats[stats["statistic"] == "count"].set_index("source")["value"]
    assert count["(all)"] == 6  # the ERROR row is not in the distribution
    assert count.drop("(all)").sum() == 6
    assert "(other)" in count.index  # three sources, two kept by name
    bins = dist[(dist["kind"] == "bin") & (dist["measure"] == "n_tokens")]
    per_source = bins.groupby("source")["value"].sum()
    assert per_source["(all)"] == 6
    edges = bins[bins["source"] == "(all)"][["bin_lo", "bin_hi"]].to_numpy()
    assert edges[0, 0] == 1.0 and edges[-1, 1] > 1000
    assert np.allclose(edges[1:, 0], edges[:-1, 1])
    ratios = edges[:, 1] / edges[:, 0]
    assert np.allclose(ratios, ratios[0])  # log-spaced
    maximum = stats[(stats["statistic"] == "max") & (stats["source"] == "(all)")]["value"]
    assert maximum.item() == 1000


def test_zero_loss_tokens_are_counted_apart_from_the_log_bins():
    frame = lengths_frame([4, 5, 6], loss=[0, 2, 3])
    dist = distribution_table(frame, n_bins=4, max_sources=5)
    loss = dist[(dist["measure"] == "n_loss_tokens") & (dist["source"] == "(all)")]
    stats = loss[loss["kind"] == "stat"].set_index("statistic")["value"]
    assert stats["n_zero"] == 1
    assert loss[loss["kind"] == "bin"]["value"].sum() == 2


def test_liger_chunk_heuristic_and_budget_chunk():
    assert next_pow2(20) == 32 and next_pow2(32) == 32 and next_pow2(1) == 1
    # ceil(262144 / 640) = 410; ceil(8192 / 410) = 20 -> 32
    assert liger_chunk_size(8192, 262144, 640) == 32
    table = ce_chunk_rows(
        {"max_seq_len": 4096, "p50": 100}, 2, {"tokenizer": 262144}, 640, budget_gib=2
    )
    row = table.set_index("shape").loc["max_seq_len"]
    assert row["tokens"] == 8192
    assert row["logits_bf16_bytes"] == 8192 * 262144 * 2
    assert row["logits_fp32_bytes"] == 8192 * 262144 * 4
    assert row["stock_loss_bytes"] == 8192 * 262144 * STOCK_BYTES_PER_LOGIT
    per_token = 262144 * STOCK_BYTES_PER_LOGIT
    assert row["chunk_bytes"] <= 2 * GIB < (row["chunk_tokens"] + 1) * per_token
    assert row["n_chunks"] == -(-8192 // row["chunk_tokens"])
    assert not row["stock_fits_budget"]
    small = table.set_index("shape").loc["p50"]
    assert small["chunk_tokens"] == 200 and small["n_chunks"] == 1 and small["stock_fits_budget"]


def test_ce_rows_per_vocab_source_when_tokenizer_and_config_differ():
    table = ce_chunk_rows({"max_seq_len": 16}, 1, {"tokenizer": 1000, "config": 1024}, 64, 1.0)
    assert table["vocab_source"].tolist() == ["tokenizer", "config"]
    assert table["vocab_size"].tolist() == [1000, 1024]


def test_ce_shapes_use_observed_percentiles_of_kept_lengths():
    frame = lengths_frame([10, 20, 30, 40, 0], statuses=["OK"] * 4 + ["EMPTY"])
    shapes = ce_shapes(frame, 64)
    assert shapes["max_seq_len"] == 64 and shapes["max"] == 40
    assert shapes["p50"] == 25  # ceil of numpy's linear percentile


def test_model_dims_reads_wrappers_text_config():
    assert model_dims({"hidden_size": 640, "vocab_size": 262144}) == (640, 262144)
    wrapped = {"text_config": {"hidden_size": 2816, "vocab_size": 262144}, "vision_config": {}}
    assert model_dims(wrapped) == (2816, 262144)
    with pytest.raises(ValueError, match="hidden_size"):
        model_dims({"vocab_size": 3})


def test_synthetic_control_reproduces_every_hand_worked_value():
    checks = synthetic_control()
    failed = [check for check in checks if not check["passed"]]
    assert not failed
    assert len(checks) >= 20


def test_brute_force_is_exact_fraction():
    assert brute_force_random_slots([1, 2], 1, 1) == Fraction(3)
