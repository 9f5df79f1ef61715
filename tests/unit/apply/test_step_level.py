"""Step-level changes as settings that paste (probes.apply.changes.step_level_changes)."""

from __future__ import annotations

from typing import Any

import transformers

from probes.apply.changes import Baseline, step_level_changes
from probes.apply.document import settings_line
from probes.step.changes import StepConfig, step_changes


def _changes() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every step-level change of an sdpa step without checkpointing, by id, as it pastes, and
    the baseline's settings they differ from."""
    base = Baseline(2, 8, 4096, 100, 40_000, 900)
    priced = step_changes(StepConfig(False, "sdpa"), 2, 8)
    provenance = [
        {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
    ]
    changes = {c["id"]: c for c in step_level_changes(provenance, base)}
    baseline = {"training_arguments": base.training_arguments(), "sft_config": base.sft_config()}
    return changes, baseline


def test_each_step_level_change_pastes_and_says_what_differs():
    changes, baseline = _changes()
    gc = changes["gradient_checkpointing_on"]
    assert gc["training_arguments"]["activation_checkpointing"] is True
    assert "activation_checkpointing=True" in settings_line(gc, baseline)
    transformers.TrainingArguments(output_dir="x", **gc["training_arguments"])  # it constructs
    eager = changes["attention_eager"]
    assert "attn_implementation='eager'" in settings_line(eager, baseline)
    # the model's own setting: from_pretrained's, never SFTConfig's model_init_kwargs (which
    # SFTTrainer ignores, with a warning, for the loaded model the snippet passes it)
    assert eager["model_kwargs"] == {"attn_implementation": "eager"}
    assert "model_init_kwargs" not in eager["sft_config"]
    assert "attn_implementation='eager'" in eager["snippets"]["trl"]["text"]
    micro = changes["micro_batch_size_4"]
    line = settings_line(micro, baseline)
    assert "per_device_train_batch_size=4" in line and "gradient_accumulation_steps=4" in line


def test_a_change_that_loads_the_model_imports_what_it_calls():
    eager = _changes()[0]["attention_eager"]
    for snippet in eager["snippets"].values():
        assert "AutoModelForCausalLM.from_pretrained" in snippet["text"]
        assert "from transformers import AutoModelForCausalLM" in snippet["imports"]


def test_the_padding_free_settings_line_names_the_flattening_collator():
    # the collator is passed as a standard trainer argument (data_collator=...), and is the
    # change's own setting: the Summary's one line must not lose it
    changes, baseline = _changes()
    flat = next(c for name, c in changes.items() if name.startswith("padding_free"))
    assert "data_collator=DataCollatorWithFlattening()" in settings_line(flat, baseline)
    eager = changes["attention_eager"]
    assert "data_collator" not in settings_line(eager, baseline)


def test_the_runs_checkpointing_comes_from_what_the_stages_saw():
    from probes.apply.changes import run_checkpointing

    priced_off = [{"strategy": "gradient_checkpointing_on"}, {"strategy": "attention_eager"}]
    priced_on = [{"strategy": "gradient_checkpointing_off"}]
    assert run_checkpointing(priced_off) is False  # the replay turned it on: the run had it off
    assert run_checkpointing(priced_on) is True
    assert run_checkpointing(None) is None and run_checkpointing([]) is None
    # the trainer's step as the padding stage recorded it wins over the replay's changes
    assert run_checkpointing(priced_off, {"gradient_checkpointing": True}) is True
    assert run_checkpointing(None, {"gradient_checkpointing": False}) is False


def test_a_checkpointed_runs_changes_keep_it_on_and_the_flip_turns_it_off():
    base = Baseline(2, 8, 4096, 100, 40_000, 900, gradient_checkpointing=True)
    priced = step_changes(StepConfig(True, "sdpa"), 2, 8)
    provenance = [
        {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
    ]
    changes = {c["id"]: c for c in step_level_changes(provenance, base)}
    assert changes["gradient_checkpointing_off"]["sft_config"]["activation_checkpointing"] is False
    assert changes["attention_eager"]["sft_config"]["activation_checkpointing"] is True
