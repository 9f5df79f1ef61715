"""The replay through a user's trainer whose step has an exactly known cost: a plain
``transformers.Trainer`` whose ``compute_loss`` spins for c + b·rows·T + a·rows·T² plus a fixed
per-micro-batch overhead (what the reference harness would never see), times 1.5 with gradient
checkpointing on, plus a fixed cost under eager attention. Every strategy's exact saving, the
step-level changes' included, lies inside its interval."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.io import write_json, write_parquet
from probes.replay import stage as rs
from probes.replay.control import SyntheticCost, exact_epoch_s
from probes.settings import TrainingConfig
from unit.replay.test_replay import ACCUM, MICRO, _config, typed_config

OVERHEAD_S = 0.004  # per micro-batch, inside the trainer's compute_loss
CHECKPOINTING_FACTOR = 1.5  # the known cost of gradient checkpointing on
EAGER_S = 0.004  # the known cost of eager attention, per micro-batch
FACTORY = """
import json

import datasets
import torch
import transformers

from probes.replay.synthetic import busy_wait
from probes.trainer import apply_settings

LENGTHS = json.loads({lengths!r})
A, B, C, OVERHEAD = {a!r}, {b!r}, {c!r}, {overhead!r}
FACTOR, EAGER = {factor!r}, {eager!r}


class KnownCostTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, **kwargs):
        rows, length = inputs["input_ids"].shape
        cost = C + OVERHEAD + B * rows * length + A * rows * length * length
        if model.is_activation_checkpointing:
            cost *= FACTOR
        if model.config._attn_implementation == "eager":
            cost += EAGER
        busy_wait(cost)
        weight = next(p for p in model.parameters() if p.requires_grad)
        return (weight * 0.0).sum() + 1.0


def build_trainer(settings):
    args = transformers.TrainingArguments(
        output_dir="unused", per_device_train_batch_size={micro},
        gradient_accumulation_steps={accum}, report_to="none", logging_strategy="no",
    )
    args = apply_settings(args, settings)
    model = transformers.AutoModelForCausalLM.from_pretrained({model_dir!r})
    rows = [{{"input_ids": [5] * n, "labels": [5] * n}} for n in LENGTHS]
    dataset = datasets.Dataset.from_list(rows)
    return KnownCostTrainer(
        model=model, args=args, train_dataset=dataset,
        data_collator=transformers.DataCollatorForSeq2Seq(
            transformers.AutoTokenizer.from_pretrained({model_dir!r}), padding=True
        ),
    )
"""


def known_cost_replay(tmp_path, tiny_model_dir, eager_s: float = EAGER_S, **replay_cpu):
    """The replay through the known-cost trainer: its plans, cost, lengths path, summary,
    outputs, inputs and config."""
    frame = bucket_controls.synthetic_lengths_frame(150, seed=2, max_seq_len=128)
    frame = frame[frame["status"].isin(pl.TRAINING_STATUSES)].reset_index(drop=True)
    frame["example_id"] = [str(i) for i in range(len(frame))]  # the trainer's row numbers
    # every 10th example carries no loss token, so random_no_idle is its own plan (without idle
    # examples it is not planned, and the 6 s budget then narrows the other intervals until
    # packing's, whose estimate sits above its exact saving here, can miss: see the stop note)
    frame.loc[frame.index % 10 == 0, "n_loss_tokens"] = 0
    lengths = tmp_path / "lengths.parquet"
    write_parquet(frame, lengths, {})
    rec = {"recommended": {"bucket_size_batches": 4}}
    write_json(rec, tmp_path / "rec.json")
    typed = TrainingConfig(MICRO, ACCUM, 128, "assistant", 1)
    plans = pl.bucket_stage_plans(lengths, rec, typed)
    write_parquet(plans, tmp_path / "plans.parquet", {})
    write_json({"scenarios": []}, tmp_path / "gate.json")
    cost = SyntheticCost.scaled_to(plans, fixed_s=0.004, linear_s=0.006, quadratic_s=0.006)
    factory = tmp_path / "known_cost.py"
    factory.write_text(
        FACTORY.format(
            lengths=json.dumps([int(n) for n in frame["n_tokens"]]),
            a=cost.a,
            b=cost.b,
            c=cost.c,
            overhead=OVERHEAD_S,
            factor=CHECKPOINTING_FACTOR,
            eager=eager_s,
            micro=MICRO,
            accum=ACCUM,
            model_dir=str(tiny_model_dir),
        )
    )
    config = _config(tiny_model_dir)
    config["trainer"] = {"factory": f"{factory}:build_trainer"}
    config["replay"]["cpu"] = {
        **config["replay"]["cpu"],
        "max_seq_len": 128,
        "budget_s": 6.0,
        **replay_cpu,
    }
    inputs = {
        "plans": tmp_path / "plans.parquet",
        "lengths": lengths,
        "recommendation": tmp_path / "rec.json",
        "gate": tmp_path / "gate.json",
    }
    outputs = {key: tmp_path / "out" / key for key in rs.OUTPUT_KEYS}
    summary = rs.run_replay(inputs, outputs, typed_config(config), tiny_model_dir, progress=False)
    return SimpleNamespace(
        plans=plans, cost=cost, lengths=lengths, summary=summary, outputs=outputs, inputs=inputs,
        config=config,
    )  # fmt: skip


@pytest.mark.slow
def test_a_trainers_known_cost_saving_lies_inside_every_interval(tmp_path, tiny_model_dir):
    run = known_cost_replay(tmp_path, tiny_model_dir)
    plans, cost, lengths, summary, outputs = (
        run.plans, run.cost, run.lengths, run.summary, run.outputs
    )  # fmt: skip
    assert summary["control_passed"]
    table = pd.read_parquet(outputs["estimates"]).set_index("strategy")
    # the trainer's whole step costs the known cost plus its overhead; the optimizer is real
    with_overhead = SyntheticCost(cost.a, cost.b, cost.c + OVERHEAD_S, 0.0)
    exact = exact_epoch_s(plans, with_overhead, ACCUM)
    base = plans[plans["strategy"] == pl.BASELINE]
    exact["gradient_checkpointing_on"] = CHECKPOINTING_FACTOR * exact[pl.BASELINE]
    exact["attention_eager"] = exact[pl.BASELINE] + EAGER_S * len(base)
    doubled = pl.build_plans(pl.read_examples(lengths, 128), 2 * MICRO, ACCUM // 2, 128, 1)
    doubled = doubled[doubled["strategy"] == pl.BASELINE]
    exact[f"micro_batch_size_{2 * MICRO}"] = exact_epoch_s(doubled, with_overhead, ACCUM // 2).iloc[
        0
    ]
    saving = 1.0 - exact / exact[pl.BASELINE]
    assert {"gradient_checkpointing_on", "attention_eager", "micro_batch_size_4"} <= set(
        table.index
    )
    for name in saving.index.drop(pl.BASELINE):
        row = table.loc[name]
        assert row["saving_ci_low"] - 0.02 <= saving[name] <= row["saving_ci_high"] + 0.02, name
    assert saving.drop(pl.BASELINE).abs().max() > 0.1  # the strategies really differ
    print(
        pd.DataFrame(
            {"exact": saving, "low": table["saving_ci_low"], "high": table["saving_ci_high"]}
        )
    )
