"""Padding-free per attention implementation (probes.step.padding_free): its plan is the
baseline's examples in one flattened row per micro-batch; the replay refuses it where the mask
gate failed or did not check its implementation, or where the step's own collator lets documents
see each other; what it pastes constructs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probes.batching import plans as pl
from probes.bucket import control as bucket_controls
from probes.io import write_json
from probes.mask import implementations as im
from probes.replay.step_changes import refused_changes
from probes.step import batches
from probes.step import changes as sc
from probes.step import padding_free as pf

MICRO, ACCUM, MAX_LEN = 2, 4, 128


@pytest.fixture(scope="module")
def plans():
    frame = bucket_controls.synthetic_lengths_frame(60, seed=3, max_seq_len=MAX_LEN)
    frame = frame[frame["status"].isin(pl.TRAINING_STATUSES)].reset_index(drop=True)
    examples = pl.PlanExamples(
        frame["example_id"].astype(str).to_numpy(dtype=object),
        frame["n_tokens"].to_numpy(np.int64),
        frame["n_loss_tokens"].fillna(0).to_numpy(np.int64),
    )
    return pl.build_plans(examples, MICRO, ACCUM, MAX_LEN, bucket_size_batches=4, seed=0)


BASE = sc.StepConfig(False, "sdpa")


def change_named(name: str) -> sc.StepChange:
    return next(c for c in sc.step_changes(BASE, MICRO, ACCUM) if c.strategy == name)


def test_one_change_per_portable_implementation_each_at_its_implementation():
    base = sc.StepConfig(True, "sdpa")
    changes = {c.strategy: c for c in sc.step_changes(base, MICRO, ACCUM)}
    assert {"padding_free_eager", "padding_free_sdpa"} <= set(changes)
    assert changes["padding_free_eager"].config == sc.StepConfig(True, "eager")
    assert changes["padding_free_sdpa"].config == base  # only the layout changes
    assert changes["padding_free_eager"].settings == {
        "padding_free": True,
        "max_length": None,
        "drop_no_loss_examples": True,
        "attn_implementation": "eager",
    }
    assert sc.is_step_change("padding_free_eager") and sc.title_of("padding_free_eager")
    # flash / flex: listed as not measurable on a CPU, never priced there
    assert {"padding_free_flash_attention_2", "padding_free_flex_attention"} <= set(
        sc.gpu_only("cpu")
    )


def test_the_plan_is_the_baselines_examples_in_one_row_per_micro_batch(plans):
    rows = sc.change_plans(plans, [change_named("padding_free_eager")], {})
    base = plans[plans["strategy"] == pl.BASELINE]
    assert len(rows) == len(base) and set(rows["strategy"]) == {"padding_free_eager"}
    for baseline, flat in zip(base.itertuples(), rows.itertuples(), strict=True):
        assert list(flat.example_ids) == list(baseline.example_ids)
        assert (flat.micro_batch_index, flat.optimizer_step_index) == (
            baseline.micro_batch_index,
            baseline.optimizer_step_index,
        )
        assert flat.layout == pl.PACKED and flat.rows == 1
        assert flat.computed_tokens == flat.real_tokens == sum(flat.example_lengths)
        assert flat.loss_tokens == baseline.loss_tokens
        assert list(flat.documents_per_row) == [baseline.n_examples]
    assert (rows["computed_tokens"] < base["computed_tokens"].to_numpy()).any()  # padding gone
    # realize rebuilds it by name alone: the same rows
    by_name = sc.change_plans(plans, sc.plan_shapes(["padding_free_eager"], MICRO, ACCUM), {})
    assert by_name.equals(rows)
    # the micro-batch a harness step gets: one row, positions restarting per document, no mask
    row = next(r for r in rows.itertuples() if r.n_examples >= 2)
    batch = batches.plan_batch(row, 64, torch.Generator().manual_seed(0))
    assert tuple(batch["input_ids"].shape) == (1, row.computed_tokens)
    assert "attention_mask" not in batch
    starts = np.cumsum([0, *row.example_lengths[:-1]])
    assert batch["position_ids"][0, starts].eq(0).all()


def gate_with(tmp_path, verdicts):
    path = tmp_path / "gate.json"
    write_json({"passed": True, "implementations": verdicts}, path)
    return {"gate": path}


PASSED = {"status": im.PASSED, "packed_checked": True, "violation": None, "reason": None}
FAILED = {
    "status": im.FAILED,
    "packed_checked": True,
    "violation": "layer 0 (sliding_attention) in scenario 'packed': row 12 attends keys [5..12]",
    "reason": None,
}


class FlatStep:
    """A step whose padding-free collator adds (or not) a 2-D attention mask."""

    def __init__(self, leaks: bool) -> None:
        self.leaks = leaks

    def collate(self, example_ids, packed):
        assert packed
        batch = {"input_ids": torch.ones(1, 8), "position_ids": torch.tensor([[0, 1, 2, 0] * 2])}
        if self.leaks:
            batch["attention_mask"] = torch.ones(1, 8)
        return batch


def test_the_replay_refuses_what_the_gate_failed_naming_the_violation(tmp_path, plans):
    changes = sc.step_changes(BASE, MICRO, ACCUM)
    added = sc.change_plans(plans, [c for c in changes if pf.is_padding_free(c.strategy)], {})
    inputs = gate_with(tmp_path, {"sdpa": PASSED, "eager": FAILED})
    refused = refused_changes(FlatStep(leaks=False), changes, added, inputs)
    assert set(refused) == {"padding_free_eager"}
    assert FAILED["violation"] in refused["padding_free_eager"]
    assert str(inputs["gate"]) in refused["padding_free_eager"]
    # a gate that never checked the implementations (an older mask stage) clears nothing
    stale = refused_changes(FlatStep(False), changes, added, gate_with(tmp_path, {}))
    assert set(stale) == {"padding_free_eager", "padding_free_sdpa"}
    # the step's own collator passing a 2-D mask beside the positions: refused whatever the gate
    inputs = gate_with(tmp_path, {"sdpa": PASSED, "eager": PASSED})
    leaking = refused_changes(FlatStep(leaks=True), changes, added, inputs)
    assert leaking == {"padding_free_eager": pf.LEAK, "padding_free_sdpa": pf.LEAK}


def test_the_trainers_own_padding_free_collators_pass_no_mask():
    from types import SimpleNamespace

    from transformers import DataCollatorForSeq2Seq
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from probes.step.trainer import packed_collator

    features = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [8, 9], "labels": [8, 9]},
    ]
    trl = packed_collator(SimpleNamespace(data_collator=DataCollatorForLanguageModeling(0)))
    assert pf.collator_leak(trl([dict(f) for f in features])) is None
    # a plain Trainer's collator has no padding-free form: transformers' flattening one
    plain = packed_collator(SimpleNamespace(data_collator=DataCollatorForSeq2Seq(None)))
    batch = plain([dict(f) for f in features])
    assert pf.collator_leak(batch) is None and batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert pf.collator_leak({**batch, "attention_mask": torch.ones(1, 5)}) == pf.LEAK


def test_what_it_pastes_constructs():
    import transformers
    import trl

    from probes.apply.changes import Baseline, step_level_changes

    base = Baseline(2, 8, 4096, 100, 40_000, 900)
    change = change_named("padding_free_eager")
    provenance = [{"strategy": change.strategy, "title": change.title, "settings": change.settings}]
    (pasted,) = step_level_changes(provenance, base)
    assert "padding_free" not in pasted["training_arguments"]
    assert pasted["sft_config"]["padding_free"] is True
    assert pasted["model_kwargs"] == {"attn_implementation": "eager"}
    assert not pasted["expressible_in_training_arguments"]
    assert "DataCollatorWithFlattening()" in pasted["snippets"]["transformers"]["text"]
    transformers.TrainingArguments(output_dir="x", **pasted["training_arguments"])
    trl.SFTConfig(output_dir="x", use_cpu=True, **pasted["sft_config"])  # no GPU here


def test_an_sft_trainer_accepts_what_it_pastes(tiny_model_dir):
    """TRL 1.16 refuses padding_free beside a max_length without packing, at SFTTrainer's
    construction (not SFTConfig's): the pasted config must build a trainer."""
    import datasets
    import transformers
    import trl

    from probes.apply.changes import Baseline, step_level_changes

    change = change_named("padding_free_sdpa")
    provenance = [{"strategy": change.strategy, "title": change.title, "settings": change.settings}]
    (pasted,) = step_level_changes(provenance, Baseline(2, 8, 4096, 100, 40_000, 900))
    sft = pasted["sft_config"]  # as pasted: the model's attention is from_pretrained's
    assert sft["max_length"] is None and "truncate" in pasted["caveat"]
    assert pasted["drop_no_loss_examples"] and "drop_no_loss_examples" not in sft
    args = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **sft)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = datasets.Dataset.from_list([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows)
    assert trainer.args.padding_free
