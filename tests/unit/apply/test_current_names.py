"""Every pasted setting uses the installed libraries' current names: constructing each
snippet's TrainingArguments / SFTConfig raises no FutureWarning or DeprecationWarning
(probes.apply.libraries.verify_snippet refuses one, sft_checkpointing avoids TRL's)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

from probes.apply import document as apply
from probes.apply import libraries
from probes.apply.changes import baseline_from, step_level_changes
from probes.apply.combined import combined_change
from probes.report.sections.replay import CHANGE_STRATEGY
from probes.step.changes import StepConfig, step_changes
from unit.apply.test_document import TRAINING, bucket_recommendation

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


def every_change() -> list[dict[str, Any]]:
    """The batching changes, every step-level change of a checkpointed and of a plain step, and
    a combination: everything the report can paste."""
    recommendation = bucket_recommendation()
    document = apply.recommendations_document(recommendation, TRAINING, verify=False)
    base = baseline_from(recommendation, TRAINING)
    changes = list(document["changes"])
    # a harness's step, and a trainer's (TRL's loss_type, its dataloader workers)
    for config in (StepConfig(False, "sdpa"), StepConfig(True, "sdpa", "nll", 0)):
        priced = step_changes(config, base.micro_batch_size, base.grad_accum)
        provenance = [
            {"strategy": c.strategy, "title": c.title, "settings": c.settings} for c in priced
        ]
        changes += step_level_changes(provenance, base)
    strategy_of = {**CHANGE_STRATEGY, **{c["id"]: c["id"] for c in changes if c.get("step_level")}}
    combined = combined_change(
        "length_grouped+micro_batch_size_4+attention_eager",
        changes,
        strategy_of,
        document["baseline"],
    )
    assert combined is not None
    ids = {c["id"] for c in changes}
    assert {"loss_dft", "dataloader_workers_2", "gradient_checkpointing_off"} <= ids
    return [*changes, combined]


def test_no_pasted_setting_raises_a_deprecation_warning():
    checked = 0
    for change in every_change():
        for library, snippet in (change.get("snippets") or {}).items():
            namespace: dict[str, Any] = {}
            exec("\n".join(snippet["imports"]), namespace)
            cls = namespace["SFTConfig" if library == "trl" else "TrainingArguments"]
            namespace[cls.__name__] = lambda cls=cls, **kw: cls(use_cpu=True, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                warnings.simplefilter("error", DeprecationWarning)
                exec(snippet["args"], namespace)  # raises on a deprecated name
            checked += 1
    assert checked >= 15  # the test saw the snippets, both libraries


def test_the_check_refuses_a_deprecated_name():
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    if libraries.CHECKPOINTING not in fields:
        pytest.skip("the installed transformers has no activation_checkpointing")
    snippet = {
        "imports": ["from transformers import TrainingArguments"],
        "args": "args = TrainingArguments(gradient_checkpointing=True)",
    }
    result = libraries.verify_snippet(snippet, {"gradient_checkpointing": True})
    assert result["verified"] is False and "FutureWarning" in result["reason"]
    snippet["args"] = "args = TrainingArguments(activation_checkpointing=True)"
    assert libraries.verify_snippet(snippet, {"activation_checkpointing": True})["verified"]


def test_sftconfig_states_trls_checkpointing_default_under_its_current_name():
    names = libraries.sft_checkpointing()
    if not names:
        pytest.skip("the installed libraries need no current-name setting")
    default = next(
        f.default for f in dataclasses.fields(trl.SFTConfig) if f.name == "gradient_checkpointing"
    )
    assert names == {libraries.CHECKPOINTING: bool(default)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = trl.SFTConfig(output_dir="x", use_cpu=True, **names)
    assert args.gradient_checkpointing is bool(default)  # the same run as TRL's default
