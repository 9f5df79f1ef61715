"""The combined configuration as settings that paste (probes.apply.combined): the batching
change's entry with the step-level changes' settings written in, constructing for real."""

from __future__ import annotations

import transformers
import trl

from probes.apply import document as apply
from probes.apply.changes import baseline_from, step_level_changes
from probes.apply.combined import combined_change
from probes.report.sections.replay import CHANGE_STRATEGY
from probes.step.changes import StepConfig, step_changes
from unit.apply.test_document import TRAINING, bucket_recommendation, build


def test_the_combination_pastes_its_parts_settings_together():
    recommendation = bucket_recommendation()
    document = apply.recommendations_document(recommendation, TRAINING, verify=False)
    base = baseline_from(recommendation, TRAINING)
    priced = step_changes(StepConfig(False, "sdpa"), base.micro_batch_size, base.grad_accum)
    provenance = [
        {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
    ]
    changes = [*document["changes"], *step_level_changes(provenance, base)]
    strategy_of = {**CHANGE_STRATEGY, **{c["id"]: c["id"] for c in changes if c.get("step_level")}}
    name = "length_grouped+micro_batch_size_4+attention_eager"
    entry = combined_change(name, changes, strategy_of, document["baseline"])
    assert entry is not None and entry["id"] == name
    assert entry["combined_of"] == ["length_grouped", "micro_batch_size_4", "attention_eager"]
    grouped = next(c for c in changes if c["id"] == "length_grouped")
    sft = entry["sft_config"]
    assert sft["per_device_train_batch_size"] == 4 and sft["gradient_accumulation_steps"] == 4
    assert entry["model_kwargs"] == {"attn_implementation": "eager"}
    assert "model_init_kwargs" not in sft
    for key, value in grouped["sft_config"].items():  # the batching change's own settings kept
        if key not in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            assert sft[key] == value, key
    text = entry["snippets"]["trl"]["text"]
    assert entry["snippets"]["trl"]["args"] in text
    assert text.count("trainer = ") == grouped["snippets"]["trl"]["text"].count("trainer = ")
    build(trl.SFTConfig, sft)  # it constructs
    if entry.get("training_arguments") is not None:
        build(transformers.TrainingArguments, entry["training_arguments"])
        assert "attn_implementation='eager'" in entry["snippets"]["transformers"]["text"]


def test_no_entry_without_its_parts():
    recommendation = bucket_recommendation()
    document = apply.recommendations_document(recommendation, TRAINING, verify=False)
    name = "length_grouped+attention_eager"  # no step-level entry for eager here
    assert combined_change(name, document["changes"], CHANGE_STRATEGY, {}) is None
