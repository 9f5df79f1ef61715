"""The step-level changes predicted on the fake model, each set as the replay sets it, at its own
largest micro-batch (probes.memory.step_changes), and read by the report's Memory column."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import workflow_config
from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.contracts import STAGE_OUTPUTS
from probes.io import read_json, read_parquet, write_parquet
from probes.mask.trace import config_from_dict
from probes.memory import control, stage
from probes.memory.predict import PACKED, CachedPredictor, Prediction, Shape, build_fake_step
from probes.memory.shapes import largest_micro_batches
from probes.memory.step_changes import (
    LoadedHarness,
    base_config,
    change_shapes,
    configured,
)
from probes.memory.tracker import ACTIVATIONS
from probes.replay.step_changes import step_changes_for
from probes.report.sections.verdicts import memory_check, verdicts_section
from probes.settings import TrainingConfig
from probes.step import changes as sc
from probes.step import reference_harness
from probes.step.harness import load_harness
from probes.step.loss_changes import LOSS_PREFIX, STOCK

# the module-scoped fixtures are built once: every test of the module on one worker
pytestmark = pytest.mark.xdist_group("memory_step_changes")

VOCAB = 2048  # large enough that the full logits are a visible block
SHAPE = Shape("step", 2, 256)  # 256 x 256 attention probabilities per head: visible too
FLOAT32 = 4


@pytest.fixture(scope="module")
def loaded():
    harness = load_harness("probes.reference_harness")
    options = {"ce_chunk_tokens": 1024}
    harness.hook("configure")(options)
    yield LoadedHarness(harness, {"options": options})
    reference_harness.configure({})


@pytest.fixture(scope="module")
def predictor(loaded):
    from probes.memory.predict import functions_of

    config = config_from_dict({**control.TINY_GEMMA3, "vocab_size": VOCAB})
    step = build_fake_step(config, functions_of(loaded.harness), "float32", grad_accum=2)
    return stage.CachedPredictor(step)


def _change(predictor, loaded, strategy):
    base = base_config(predictor.step, loaded, "sdpa")
    (change,) = [c for c in sc.step_changes(base, 2, 2) if c.strategy == strategy]
    return base, change


def _predict(predictor, loaded, strategy, shape=SHAPE):
    base, change = _change(predictor, loaded, strategy)
    with configured(predictor, loaded, base, change):
        return predictor(shape)


def test_the_base_is_read_as_the_replay_reads_it(predictor, loaded):
    base = base_config(predictor.step, loaded, "sdpa")
    assert base == sc.StepConfig(False, "sdpa", "chunked")
    names = [c.strategy for c in sc.step_changes(base, 2, 2)]
    assert names[:2] == [sc.GC_ON, "attention_eager"] and LOSS_PREFIX + STOCK in names


def test_checkpointing_on_predicts_fewer_activations(predictor, loaded):
    off = predictor(SHAPE)
    on = _predict(predictor, loaded, sc.GC_ON)
    assert on.by_category[ACTIVATIONS] < 0.7 * off.by_category[ACTIVATIONS]
    assert on.peak_bytes < off.peak_bytes


def test_stock_loss_holds_about_the_full_logit_block_more(predictor, loaded):
    chunked = predictor(SHAPE)
    stock = _predict(predictor, loaded, LOSS_PREFIX + STOCK)
    block = SHAPE.rows * SHAPE.length * VOCAB * FLOAT32
    assert 0.5 * block < stock.peak_bytes - chunked.peak_bytes < 2 * block
    assert reference_harness.OPTIONS["loss_kernel"] == "chunked"  # set back


def test_eager_holds_the_attention_probabilities(predictor, loaded):
    sdpa = predictor(SHAPE)
    eager = _predict(predictor, loaded, "attention_eager")
    heads = control.TINY_GEMMA3["num_attention_heads"]
    one_layer = SHAPE.rows * heads * SHAPE.length**2 * FLOAT32
    assert eager.peak_bytes - sdpa.peak_bytes > one_layer
    short = Shape("short", 2, 16)  # 16 x 16 probabilities: a small difference
    short_gap = (
        _predict(predictor, loaded, "attention_eager", short).peak_bytes
        - predictor(short).peak_bytes
    )
    assert short_gap < (eager.peak_bytes - sdpa.peak_bytes) / 20


def test_a_change_is_set_back_so_the_order_does_not_matter(predictor, loaded):
    before = predictor.predict_fn(predictor.step, SHAPE).peak_bytes
    for strategy in (sc.GC_ON, "attention_eager", LOSS_PREFIX + STOCK):
        _predict(predictor, loaded, strategy)
    assert predictor.predict_fn(predictor.step, SHAPE).peak_bytes == before
    assert base_config(predictor.step, loaded, "sdpa") == sc.StepConfig(False, "sdpa", "chunked")
    assert predictor.step.grad_accum == 2 and predictor.setting == ()


# ----------------------------------------------------------------------------- the stage


MICRO, ACCUM, MAX_LEN = 2, 4, 128


@pytest.fixture(scope="module")
def bucket_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp_path = tmp_path_factory.mktemp("memory_step_changes")
    frame = bucket_controls.synthetic_lengths_frame(120, seed=3, max_seq_len=MAX_LEN)
    lengths = tmp_path / "lengths.parquet"
    write_parquet(frame, lengths, {})
    rec = {"recommended": {"bucket_size_batches": 4}}
    training = TrainingConfig(MICRO, ACCUM, MAX_LEN, "assistant", 1)
    plans = tmp_path / "plans.parquet"
    built = pl.bucket_stage_plans(lengths, rec, training, seed=3)
    write_parquet(built, plans, {"plan_seed": 3})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(control.TINY_GEMMA3))
    return {"model_config": str(config), "plans": str(plans), "lengths": str(lengths)}


def _config(**sections):
    return workflow_config(
        training={"micro_batch_size": MICRO, "grad_accum": ACCUM, "max_seq_len": MAX_LEN},
        mask={"dtype": "float32"},
        memory={
            "target_gib": 139,
            "allocator_round_bytes": 1,
            "scale_layers": False,
            "world_sizes": [],
        },  # fmt: skip
        **sections,
    )


def _run(tmp_path, inputs, **sections):
    from probes.contracts import STAGE_OUTPUTS

    cfg = _config(**sections)
    out = tmp_path / "out"
    outputs = {k: str(out / Path(rel).name) for k, rel in STAGE_OUTPUTS["memory"].items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage, "run_controls", lambda *a: {"observed": "skipped in this test"})
        stage.run(inputs, outputs, cfg)
    return outputs


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, bucket_inputs) -> dict[str, str]:
    return _run(tmp_path_factory.mktemp("default_run"), bucket_inputs)


def test_the_stage_predicts_every_step_change_at_its_own_largest_micro_batch(
    default_run, bucket_inputs
):
    outputs = default_run
    table = read_parquet(outputs["changes"]).set_index("strategy")
    base = sc.StepConfig(False, "sdpa", "chunked")
    names = [c.strategy for c in sc.step_changes(base, MICRO, ACCUM)]
    assert read_json(outputs["summary"])["step_changes"] == names
    assert set(names) <= set(table.index)
    assert (table.loc[names, "verdict"] == "fits").all()
    plans = read_parquet(bucket_inputs["plans"])
    baseline = largest_micro_batches(plans)[pl.BASELINE]
    for name in (sc.GC_ON, "attention_eager", LOSS_PREFIX + STOCK):
        assert tuple(table.loc[name, ["shape_rows", "shape_length"]]) == (
            baseline.rows,
            baseline.length,
        )
    # micro-batch size 4: the largest micro-batch of its own plan (the replay's builder)
    (micro,) = [c for c in sc.step_changes(base, MICRO, ACCUM) if c.micro_batch_size]
    examples = pl.read_examples(bucket_inputs["lengths"], MAX_LEN)
    own = sc.micro_batch_plans([micro], examples, MAX_LEN, 3)[micro.strategy]
    expected = largest_micro_batches(own)[pl.BASELINE]
    assert micro.strategy == "micro_batch_size_4" and expected.rows == 4
    row = table.loc[micro.strategy]
    assert (row["shape_rows"], row["shape_length"]) == (expected.rows, expected.length)
    # padding-free: the baseline's micro-batch with the most real tokens, in one row
    most = int(plans.loc[plans["strategy"] == pl.BASELINE, "real_tokens"].max())
    for name in ("padding_free_sdpa", "padding_free_eager"):
        assert table.loc[name, "layout"] == PACKED
        assert tuple(table.loc[name, ["shape_rows", "shape_length"]]) == (1, most)
    shapes = read_parquet(outputs["shapes"]).set_index("shape")
    # eager keeps the attention probabilities: more than sdpa on the same flattened row
    assert (
        shapes.loc["padding_free_eager", "predicted_peak_gib"]
        > shapes.loc["padding_free_sdpa", "predicted_peak_gib"]
    )


def test_checkpointing_on_in_the_harness_prices_turning_it_off(tmp_path, bucket_inputs):
    outputs = _run(
        tmp_path, bucket_inputs, profile={"harness_options": {"gradient_checkpointing": True}}
    )
    table = read_parquet(outputs["changes"]).set_index("strategy")
    assert sc.GC_OFF in table.index and sc.GC_ON not in table.index
    assert table.loc[sc.GC_OFF, "predicted_peak_gib"] > table.loc["random", "predicted_peak_gib"]
    reference_harness.configure({})


def test_without_plans_the_changes_take_the_training_shape():
    base = sc.StepConfig(False, "sdpa", "chunked")
    changes = sc.step_changes(base, 2, 8)
    training = TrainingConfig(2, 8, 4096, "assistant", 1)
    shapes = change_shapes(changes, None, {}, training, False)
    assert shapes["micro_batch_size_4"] == Shape("micro_batch_size_4", 4, 4096)
    assert shapes["padding_free_sdpa"] == Shape("padding_free_sdpa", 1, 8192, PACKED)
    assert shapes[sc.GC_ON] == Shape(sc.GC_ON, 2, 4096)


def test_plans_without_lengths_say_why_the_micro_batch_size_is_not_predicted(bucket_inputs):
    base = sc.StepConfig(False, "sdpa", "chunked")
    changes = sc.step_changes(base, MICRO, ACCUM)
    plans = read_parquet(bucket_inputs["plans"])
    training = TrainingConfig(MICRO, ACCUM, MAX_LEN, "assistant", 1)
    shapes = change_shapes(changes, plans, {}, training, False)
    assert "no lengths input" in shapes["micro_batch_size_4"]
    assert isinstance(shapes["attention_eager"], Shape)


def test_the_report_reads_a_step_level_change_from_the_table(default_run):
    frame = read_parquet(default_run["changes"])
    headroom = float(frame.set_index("strategy").loc["attention_eager", "headroom_gib"])
    assert memory_check(frame, "attention_eager")["text"] == f"fits, {headroom:.1f} GiB headroom"
    measured = {
        "rows": [
            {"strategy": "attention_eager", "baseline": False, "versus": "random batches",
             "verdict": "faster", "rank": 1, "tied": False, "title": "Use eager",
             "saving": 0.1, "saving_low": 0.05, "saving_high": 0.15}
        ],
        "not_recommended": [],
    }  # fmt: skip
    (row,) = verdicts_section(measured, {"status": "not_run"}, frame, None)["rows"]
    assert row["memory"].startswith("fits, ") and row["memory"] != "not predicted"
    # a combined configuration is not predicted by the memory stage: the report reads its parts
    combined = memory_check(frame, "length_grouped+attention_eager")
    assert combined["verdict"] == "not predicted"
    assert combined["text"].startswith("not predicted together; each part fits")


def test_unpredicted_rows_keep_the_table_columns():
    row = stage.unpredicted_row("micro_batch_size_4", "no lengths input", 2**30)
    frame = pd.DataFrame([row])
    assert frame.loc[0, "verdict"] == "unknown"
    assert memory_check(frame, "micro_batch_size_4")["text"] == "unknown: no lengths input"


def test_a_setting_the_model_refuses_is_that_changes_answer(predictor, loaded, monkeypatch):
    """A model without an attention implementation, or a harness rejecting an option, raises
    ValueError when the change is set: that change's row says so, the others are predicted."""
    from contextlib import contextmanager

    real = stage.configured

    @contextmanager
    def refusing(predictor, harness, base, change):
        if change.strategy == "attention_eager":
            raise ValueError("eager is not supported by this model")
        with real(predictor, harness, base, change):
            yield

    monkeypatch.setattr(stage, "configured", refusing)
    cfg = workflow_config(training={"micro_batch_size": 2, "grad_accum": 2, "max_seq_len": 64})
    base = base_config(predictor.step, loaded, "sdpa")
    rows = stage.step_change_rows(
        predictor, stage.StepChangeQuery(loaded, base, cfg, {}, None, 2**40)
    )
    by_strategy = {r["strategy"]: r for r in rows}
    refused = by_strategy.pop("attention_eager")
    assert "eager is not supported" in refused["reason"]
    assert refused["predicted_peak_gib"] is None
    assert by_strategy and all(r["predicted_peak_gib"] for r in by_strategy.values())


# ------------------------------------------------- the same base and changes as the replay's


def test_a_gpu_only_profile_attention_names_the_replays_changes(
    tmp_path, tiny_model_dir, bucket_inputs
):
    """profile.attn_implementation flex_attention: the replay loads the real model at it and
    prices eager and SDPA against it; memory names the same changes from the same base (its fake
    model stands SDPA in for flex), where it had read the stand-in as the base."""
    import torch

    from probes.step.load import load_step

    profile = {"attn_implementation": "flex_attention"}
    runner, *_ = load_step(
        _config(profile=profile), tiny_model_dir, torch.device("cpu"), torch.float32, None
    )
    replay_base = sc.StepSwitch(runner).base
    assert replay_base.attn_implementation == "flex_attention"
    names = [c.strategy for c in step_changes_for(replay_base, _config().training)]
    assert "attention_sdpa" in names and "attention_eager" in names
    inputs = {**bucket_inputs, "model_config": str(tiny_model_dir / "config.json")}
    outputs = _run(tmp_path, inputs, profile=profile)
    summary = read_json(outputs["summary"])
    assert summary["step_changes"] == names
    assert summary["step_base"] == dataclasses.asdict(replay_base)
    table = read_parquet(outputs["changes"]).set_index("strategy")
    assert table.loc[names, "predicted_peak_gib"].notna().all()
    shapes = read_parquet(outputs["shapes"]).set_index("shape")
    assert "flex_attention: predicted as sdpa" in shapes.loc["training", "assumptions"]


def _trainer_lengths(tmp_path, lengths, model, args):
    """The lengths table with a trainer's step recorded in its provenance, as padding records it
    for a trainer run (probes.step.changes.config_record)."""
    record = {"trainer": {sc.RECORD_KEY: sc.config_record(model, args)}}
    path = tmp_path / "trainer_lengths.parquet"
    write_parquet(read_parquet(lengths), path, record)
    return str(path)


def test_a_trainers_checkpointing_and_attention_give_the_replays_changes(tmp_path, bucket_inputs):
    """A trainer whose args turn checkpointing on, its model at eager: the replay's base (StepSwitch
    on the trainer) prices turning it off and SDPA; memory names the same, from the trainer's
    step as recorded beside its lengths, not from the harness options and the profile."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    config = config_from_dict(dict(control.TINY_GEMMA3))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    args = SimpleNamespace(**{sc.checkpointing_field(): True})
    trainer = SimpleNamespace(model=model, trainer=SimpleNamespace(args=args))
    replay_base = sc.StepSwitch(trainer).base
    assert replay_base == sc.StepConfig(True, "eager", None)
    names = [c.strategy for c in step_changes_for(replay_base, _config().training)]
    assert sc.GC_OFF in names and sc.GC_ON not in names and "attention_sdpa" in names
    lengths = _trainer_lengths(tmp_path, bucket_inputs["lengths"], model, args)
    inputs = {**bucket_inputs, "lengths": lengths}
    outputs = _run(tmp_path, inputs, trainer={"factory": "train.py:build_trainer"})
    summary = read_json(outputs["summary"])
    assert summary["step_changes"] == names and summary["gradient_checkpointing"] is True
    assert summary["step_base"] == dataclasses.asdict(replay_base)
    table = read_parquet(outputs["changes"]).set_index("strategy")
    # checkpointing on is the trainer's base: turning it off holds more activations
    assert table.loc[sc.GC_OFF, "predicted_peak_gib"] > table.loc["random", "predicted_peak_gib"]


# ------------------------------------------- in a forked child, beside the shape predictions


def _stage_predictor(loaded):
    """A fresh predictor at its base, as the stage builds it."""
    from probes.memory.predict import functions_of
    from probes.memory.step_changes import at_base

    config = config_from_dict(dict(control.TINY_GEMMA3))
    predictor, _ = stage.build_predictor(_config(), config, functions_of(loaded.harness))
    base = base_config(predictor.step, loaded, "sdpa")
    at_base(predictor, base)
    return predictor, base


def _untimed(rows):
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def test_the_forked_child_gives_the_rows_and_count_of_the_in_process_path(loaded, bucket_inputs):
    """The same rows from the child as from this process (the same predictor, predicting them
    meanwhile), and the child's predictions, all made here too, counted once."""
    cfg, plans = _config(), read_parquet(bucket_inputs["plans"])
    predictor, base = _stage_predictor(loaded)
    query = stage.StepChangeQuery(loaded, base, cfg, bucket_inputs, plans, 2**40)
    with stage.step_changes_beside(predictor, query) as step_rows:
        in_process = stage.step_change_rows(predictor, query)
        count = predictor.count
        forked = step_rows()
    assert len(in_process) == len(step_changes_for(base, cfg.training)) and count > 0
    assert _untimed(forked) == _untimed(in_process)
    assert predictor.count == count


def test_a_childs_predictions_are_counted_once():
    made = {("key",): Prediction(Shape("s", 1, 8), 1, {}, 0, "phase", "op", 0.0, 1)}
    predictor = CachedPredictor(step=None)
    predictor.absorb(made)
    predictor.absorb(made)
    assert predictor.count == 1 and predictor.cache == made
    assert predictor.made_since(set()) == made and predictor.made_since(set(made)) == {}


def test_a_failing_child_is_one_error_naming_the_step_change_predictions_and_no_outputs(
    tmp_path, bucket_inputs, monkeypatch, caplog
):
    import logging

    from probes.stage import call_stage

    def fail(*args):
        raise ValueError("no such change")

    monkeypatch.setattr(stage, "step_change_rows", fail)  # the forked child inherits the patch
    monkeypatch.setattr(stage, "run_controls", lambda *a: {"observed": "skipped in this test"})
    outputs = {k: str(tmp_path / Path(rel).name) for k, rel in STAGE_OUTPUTS["memory"].items()}
    log = logging.getLogger("probes.memory")
    with caplog.at_level(logging.ERROR):
        inputs = {"model_config": bucket_inputs["model_config"]}  # the training shape only
        assert call_stage(stage.run, inputs, outputs, _config(), log) == 1
    message = caplog.records[-1].getMessage()
    assert message.startswith("the memory stage's step-change predictions (child process ")
    assert message.endswith(" failed: ValueError: no such change")
    assert not any(Path(path).exists() for path in outputs.values())
