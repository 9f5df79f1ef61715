"""The memory stage end to end on a tiny Gemma 3 config.json and a small plan (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import workflow_config
from probes.batching.plans import PLAN_COLUMNS
from probes.contracts import STAGE_OUTPUTS, check_table_columns
from probes.errors import ProbeError
from probes.io import read_json, read_parquet
from probes.memory import control, stage
from probes.memory.verdict import DOES_NOT_FIT, FITS


def write_plans(path: Path) -> Path:
    def row(strategy, layout, rows, length, computed, lengths):
        values = {
            "strategy": strategy,
            "micro_batch_index": 0,
            "optimizer_step_index": 0,
            "layout": layout,
            "rows": rows,
            "padded_length": length,
            "computed_tokens": computed,
            "real_tokens": sum(lengths),
            "loss_tokens": sum(lengths) // 2,
            "n_examples": len(lengths),
            "example_ids": [f"e{i}" for i in range(len(lengths))],
            "example_lengths": lengths,
            "example_loss_tokens": [n // 2 for n in lengths],
            "documents_per_row": [1] * rows,
        }
        return [values[c] for c in PLAN_COLUMNS]

    rows = [
        row("random", "padded", 2, 64, 128, [64, 20]),
        row("random", "padded", 2, 30, 60, [30, 10]),
        row("packing", "packed", 2, 64, 124, [64, 30, 20, 10]),
        row("length_grouped", "padded", 16, 64, 1024, [64] * 16),
    ]
    pd.DataFrame(rows, columns=list(PLAN_COLUMNS)).to_parquet(path)
    return path


@pytest.fixture
def tiny_inputs(tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(control.TINY_GEMMA3))
    return {"model_config": str(config), "plans": str(write_plans(tmp_path / "plans.parquet"))}


def outputs_in(directory: Path) -> dict[str, str]:
    return {key: str(directory / Path(rel).name) for key, rel in STAGE_OUTPUTS["memory"].items()}


def test_stage_writes_every_table_with_verdicts(tmp_path, tiny_inputs, monkeypatch):
    monkeypatch.setattr(stage, "run_controls", lambda *a: {"observed": "skipped in this test"})
    # a target between the tiny model's 2 x 64 step and its 16 x 64 micro-batch
    cfg = workflow_config(
        training={"micro_batch_size": 2, "grad_accum": 2, "max_seq_len": 64},
        mask={"dtype": "float32"},
        memory={
            "target_gib": 0.008,
            "allocator_round_bytes": 1,
            "scale_layers": False,
            "world_sizes": [1, 2],
            "every_world_size": True,
        },  # fmt: skip
    )
    outputs = outputs_in(tmp_path / "out")
    stage.run(tiny_inputs, outputs, cfg)
    for name in ("shapes", "changes", "fit", "sharded"):
        check_table_columns(read_parquet(outputs[name]).columns, f"memory_{name}", outputs[name])
    changes = read_parquet(outputs["changes"]).set_index("strategy")
    assert changes.loc["training", "verdict"] == FITS
    assert changes.loc["random", "verdict"] == FITS
    assert changes.loc["length_grouped", "verdict"] == DOES_NOT_FIT
    # checkpointing is off: the stage predicts the shape with it on and says whether that fits
    assert changes.loc["length_grouped", "reason"].startswith("with gradient checkpointing ")
    # transformers' BatchRebalanceSampler on the plan's examples (micro_batch_size x grad_accum
    # = 4 rows at most): its largest micro-batch is predicted too
    assert changes.loc["batch_rebalance", "shape_rows"] <= 4
    assert tuple(changes.loc["packing", ["shape_rows", "shape_length"]]) == (1, 124)
    fit = read_parquet(outputs["fit"]).set_index("length_kind").loc["max_seq_len"]
    assert fit["max_micro_batch_size"] * fit["grad_accum"] == 4
    # FSDP2 at each configured world size for the training shape; the smallest that fits
    sharded = read_parquet(outputs["sharded"]).set_index("world_size")
    assert list(sharded.index) == [1, 2] and set(sharded["verdict"]) == {FITS}
    assert sharded.loc[2, "optimizer_state_gib"] < sharded.loc[1, "optimizer_state_gib"]
    training = read_parquet(outputs["shapes"]).set_index("shape").loc["training"]
    assert training["smallest_world_size"] == 1
    assert training["fits_on_gpus"] == "fits on 1 H200 GPU (FSDP2)"
    summary = read_json(outputs["summary"])
    assert summary["target"] == "H200" and summary["plans"] == "read"


def test_bad_model_config_names_the_key(tmp_path, tiny_inputs, monkeypatch):
    monkeypatch.setattr(stage, "run_controls", lambda *a: {"observed": "skipped"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ProbeError, match="model_type"):
        inputs = {**tiny_inputs, "model_config": str(bad)}
        stage.run(inputs, outputs_in(tmp_path), workflow_config())
