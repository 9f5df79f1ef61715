"""Shapes from the plans, verdicts, the largest micro-batch that fits, and the stage's tables."""

from __future__ import annotations

import pandas as pd
import pytest

from probes.memory import stage
from probes.memory.predict import PACKED, PredictError, Prediction, Shape
from probes.memory.shapes import ShapesError, largest_micro_batches, quantile_length
from probes.memory.tracker import CATEGORIES
from probes.memory.verdict import (
    DOES_NOT_FIT,
    FITS,
    GIB,
    UNKNOWN,
    largest_fitting_rows,
    verdict,
)


def plans() -> pd.DataFrame:
    rows = [
        # strategy, layout, rows, padded_length, computed_tokens, loss_tokens, lengths
        ("random", "padded", 2, 100, 200, 50, [100, 40]),
        ("random", "padded", 2, 30, 60, 20, [30, 10]),
        ("batch_rebalance", "padded", 7, 90, 630, 300, [90] * 7),
        ("batch_rebalance", "padded", 2, 100, 200, 90, [100, 30]),
        ("packing", "packed", 2, 128, 230, 100, [100, 90, 40]),
    ]
    return pd.DataFrame(
        rows,
        columns=["strategy", "layout", "rows", "padded_length", "computed_tokens",
                 "loss_tokens", "example_lengths"],
    )  # fmt: skip


def test_largest_micro_batch_per_strategy():
    largest = largest_micro_batches(plans())
    assert largest["random"] == Shape("random", 2, 100, "padded", 50)
    assert largest["batch_rebalance"] == Shape("batch_rebalance", 7, 90, "padded", 300)
    assert largest["packing"] == Shape("packing", 1, 230, PACKED, 100)


def test_quantile_length_and_bad_inputs_name_the_key():
    assert quantile_length(plans(), 0.99) == 100
    assert quantile_length(plans(), 0.5) == 40
    with pytest.raises(ShapesError, match="memory.length_quantile"):
        quantile_length(plans(), 1.5)
    with pytest.raises(ShapesError, match="'example_lengths'"):
        quantile_length(plans().drop(columns=["example_lengths"]), 0.99)
    with pytest.raises(ShapesError, match="computed_tokens"):
        largest_micro_batches(plans().drop(columns=["computed_tokens"]), "p.parquet")


def test_verdicts_are_three_way():
    assert verdict(10, 10) == FITS
    assert verdict(11, 10) == DOES_NOT_FIT
    assert verdict(None, 10) == UNKNOWN


def test_largest_fitting_rows_is_a_divisor_confirmed_by_a_prediction():
    calls = []

    def peak(rows):  # affine: 10 fixed + 3 per row
        calls.append(rows)
        return 10 + 3 * rows

    found = largest_fitting_rows(peak, target_bytes=40, rows_per_update=16)
    assert (found.rows, found.grad_accum, found.peak_bytes) == (8, 2, 34)
    assert calls == [1, 2, 8]  # the line picks 10 rows: the largest divisor under it, predicted
    assert largest_fitting_rows(peak, 12, 16).rows == 0  # not even one row


class FakePredictor:
    """Peak = 1 GiB fixed + 1 GiB per `per` computed positions; one shape cannot be predicted."""

    def __init__(self, per: int) -> None:
        self.per = per

    def __call__(self, shape: Shape) -> Prediction:
        if shape.name == "broken":
            raise PredictError("shape broken: fake tensors cannot follow aten.nonzero")
        total = GIB + GIB * shape.rows * shape.length // self.per
        split = dict.fromkeys(CATEGORIES, 0)
        split["parameters"], split["activations"] = GIB, total - GIB
        return Prediction(shape, total, split, GIB, "backward", "mm", 0.0, 0)


def test_a_change_whose_largest_micro_batch_exceeds_the_target_does_not_fit():
    shapes = [("", Shape("training", 2, 100))] + [
        (s, shape) for s, shape in largest_micro_batches(plans()).items()
    ]
    shapes.append(("broken", Shape("broken", 1, 10)))
    target = int(3.5 * GIB)
    table = stage.shapes_frame(shapes, FakePredictor(100), target, checkpointing=False)
    changes = stage.changes_frame(table).set_index("strategy")
    # batch_rebalance packs 7 rows of 90 into its largest micro-batch: 1 + 6.3 GiB > 3.5 GiB
    assert changes.loc["batch_rebalance", "verdict"] == DOES_NOT_FIT
    assert changes.loc["batch_rebalance", "headroom_gib"] < 0
    assert "gradient checkpointing" in changes.loc["batch_rebalance", "reason"]
    assert changes.loc["random", "verdict"] == FITS
    assert changes.loc["training", "verdict"] == FITS
    assert changes.loc["broken", "verdict"] == UNKNOWN
    assert "aten.nonzero" in changes.loc["broken", "reason"]


def test_training_shape_that_does_not_fit_says_how_many_rows_would():
    class Cfg:
        class training:  # noqa: N801
            micro_batch_size, grad_accum, max_seq_len = 8, 2, 1000

    shapes = [("", Shape("training", 8, 1000))]
    predictor = FakePredictor(1000)
    target = int(4.5 * GIB)
    table = stage.shapes_frame(shapes, predictor, target, checkpointing=True)
    fit = stage.fitting_frame(shapes, predictor, target, Cfg)
    assert fit.loc[0, "max_micro_batch_size"] == 2 and fit.loc[0, "grad_accum"] == 8
    table = stage.add_fitting_advice(table, fit, target, checkpointing=True)
    assert table.loc[0, "verdict"] == DOES_NOT_FIT
    assert "at most 2 rows per micro-batch" in table.loc[0, "reason"]


def test_batch_rebalance_largest_micro_batch_from_transformers_sampler():
    from probes.batching import rebalance
    from probes.memory.shapes import rebalance_shape

    frame = plans().assign(example_loss_tokens=lambda f: f["example_lengths"])
    if rebalance.unavailable_reason():
        pytest.skip(rebalance.unavailable_reason())
    found = rebalance_shape(frame, micro_batch_size=1, grad_accum=2, seed=0)
    assert found.name == "batch_rebalance" and found.rows >= 1 and found.length in (100, 30, 40)
    assert "grad_accum" in rebalance_shape(frame, 1, grad_accum=50, seed=0)


def test_a_change_that_does_not_fit_is_not_recommended():
    """The memory stage's verdict carried to what the user reads: recommendations.json marks
    the change not recommended, Apply it and the first screen say not to apply it as it is."""
    from probes.apply.document import RECOMMENDED, with_checks
    from probes.report.sections.apply import memory_text
    from probes.report.sections.verdicts import memory_check, next_action

    shapes = [(s, shape) for s, shape in largest_micro_batches(plans()).items()]
    table = stage.shapes_frame(shapes, FakePredictor(100), int(3.5 * GIB), checkpointing=False)
    changes = stage.changes_frame(table)
    strategy_of = {"rebalance": "batch_rebalance", "pack": "packing"}
    document = {
        "baseline": {},
        "changes": [
            {"id": i, "applies": False, "recommended": True, "decision": RECOMMENDED}
            for i in strategy_of
        ],
    }
    memory = {s: memory_check(changes, s) for s in strategy_of.values()}
    out = {c["id"]: c for c in with_checks(document, strategy_of, None, None, memory)["changes"]}
    rebalance, pack = out["rebalance"], out["pack"]
    assert rebalance["memory"]["verdict"] == DOES_NOT_FIT and rebalance["recommended"] is False
    assert "does not fit the target GPU" in rebalance["not_recommended_because"]
    assert rebalance["decision"] == RECOMMENDED  # what the replay measured stays said
    assert pack["memory"]["verdict"] == FITS and pack["recommended"] is True
    assert "not_recommended_because" not in pack
    assert memory_text(rebalance["memory"]).endswith("do not apply it as it is")
    assert next_action(None, memory["batch_rebalance"], True).startswith("do not apply")
