"""The replay prices the loss kernel on the same footing as the other changes: a harness whose
step has an exactly known cost, c + b·rows·T + a·rows·T², plus a known cost of the LM head over
every position when its ``loss_kernel`` is ``stock`` (what the full logits add), flipped through
its own ``configure`` between timed micro-batches. Every strategy's exact saving, the loss
change's included, lies inside its interval."""

from __future__ import annotations

import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.io import read_provenance
from probes.replay import stage as rs
from probes.step.synthetic import SyntheticCost, exact_epoch_s
from unit.replay.test_replay import ACCUM, _config, _stage_inputs, typed_config

HEAD_S = 0.006  # the stock loss's extra cost at the largest padded micro-batch
HARNESS = """
import time

from probes.step.reference_harness import discover_target_modules  # noqa: F401

LOSS_KERNELS = ("chunked", "stock")
A, B, C, HEAD = {a!r}, {b!r}, {c!r}, {head!r}
OPTIONS = {{}}


def configure(options):
    OPTIONS.clear()
    OPTIONS.update({{"loss_kernel": "chunked"}}, **options)


def compute_loss(model, batch):
    rows, length = batch["input_ids"].shape
    cost = C + B * rows * length + A * rows * length * length
    if OPTIONS["loss_kernel"] == "stock":
        cost += HEAD * rows * length  # the head over every position
    end = time.perf_counter() + cost
    while time.perf_counter() < end:  # busy, as a step is (a sleep would free the CPU)
        pass
    weight = next(p for p in model.parameters() if p.requires_grad)
    return (weight * 0.0).sum() + 1.0
"""


def _head_per_token(plans: pd.DataFrame) -> float:
    padded = plans[plans["layout"] == pl.PADDED]
    return HEAD_S / max(rows * length for rows, length in map(pl.batch_shape, padded.itertuples()))


@pytest.mark.slow
def test_a_harness_whose_loss_kernel_has_a_known_cost_has_its_saving_inside_its_interval(
    tmp_path, tiny_model_dir
):
    inputs, outputs = _stage_inputs(tmp_path)
    plans = pd.read_parquet(inputs["plans"])
    cost = SyntheticCost.scaled_to(plans, fixed_s=0.002, linear_s=0.006, quadratic_s=0.006)
    head = _head_per_token(plans)
    harness = tmp_path / "known_loss_harness.py"
    harness.write_text(HARNESS.format(a=cost.a, b=cost.b, c=cost.c, head=head))
    config = _config(tiny_model_dir)
    config["profile"]["harness"] = str(harness)
    config["replay"]["cpu"] = {**config["replay"]["cpu"], "max_seq_len": 128, "budget_s": 6.0}
    summary = rs.run_replay(inputs, outputs, typed_config(config), tiny_model_dir, progress=False)
    assert summary["control_passed"]
    table = pd.read_parquet(outputs["estimates"]).set_index("strategy")
    # the harness's step costs the known cost; the optimizer (LoRA's AdamW) is real and small
    exact = exact_epoch_s(plans, SyntheticCost(cost.a, cost.b, cost.c, 0.0), ACCUM)
    base = plans[plans["strategy"] == pl.BASELINE]
    tokens = sum(rows * length for rows, length in map(pl.batch_shape, base.itertuples()))
    exact["loss_stock"] = exact[pl.BASELINE] + head * tokens
    saving = 1.0 - exact / exact[pl.BASELINE]
    assert saving["loss_stock"] < -0.1  # the stock loss really costs more
    # the loss change's (the batching strategies' coverage is the trainer test's and the
    # coverage control's: twelve 95% intervals here would miss one run in two)
    row = table.loc["loss_stock"]
    assert row["saving_ci_low"] - 0.02 <= saving["loss_stock"] <= row["saving_ci_high"] + 0.02
    assert "step-level change: loss kernel: stock loss" in table.loc["loss_stock", "note"]
    # the switch set the stock loss for each of its micro-batches: none ran faster than its cost
    steps = pd.read_parquet(outputs["steps"])
    stock = steps[(steps["strategy"] == "loss_stock") & (steps["status"] == "OK")]
    assert len(stock) >= 2
    for row in stock.itertuples():
        rows, length = pl.batch_shape(row)
        floor = cost.micro_batch_s(rows, length) + head * rows * length
        assert min(row.times_s) >= floor, (rows, length)
    provenance = read_provenance(outputs["estimates"])
    settings = {c["strategy"]: c["settings"] for c in provenance["step_changes"]}
    assert settings["loss_stock"] == {"harness_options": {"loss_kernel": "stock"}}
    not_measured = provenance["not_measured"]
    assert not_measured["loss_cut_cross_entropy"] == "GPU only: not measured on this device"
    assert "loss_liger_fused_linear_cross_entropy" in not_measured
