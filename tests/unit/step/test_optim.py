"""A trainer's optim alternatives (probes.step.optim): the installed ones listed with why the
replay does not price them; nothing on the harness path."""

from __future__ import annotations

from types import SimpleNamespace

import transformers

from probes.step import optim


def test_the_torch_adamw_pair_is_always_offered_and_a_missing_backend_is_not():
    names = optim.installed_optims()
    assert {"adamw_torch", "adamw_torch_fused"} <= set(names)
    assert set(names) <= set(optim.CANDIDATES)


def test_each_alternative_to_the_trainers_optimizer_says_why_it_is_not_priced():
    args = transformers.TrainingArguments(output_dir="x", use_cpu=True, optim="adamw_torch_fused")
    unpriced = optim.unpriced_optims(SimpleNamespace(args=args))
    assert "optim_adamw_torch_fused" not in unpriced  # the trainer's own
    assert unpriced["optim_adamw_torch"].startswith("optim='adamw_torch' against")
    assert optim.NOT_TIMED in unpriced["optim_adamw_torch"]
    assert optim.unpriced_optims(None) == {}  # a harness: its optimizer is its own


def test_the_replay_lists_them_beside_what_the_device_cannot_run():
    from probes.replay.step_changes import not_measured

    args = transformers.TrainingArguments(output_dir="x", use_cpu=True, optim="adamw_torch")
    step = SimpleNamespace(trainer=SimpleNamespace(args=args), harness=None)
    assert "optim_adamw_torch_fused" in not_measured(step, cpu_only=True)
