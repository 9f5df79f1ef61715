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


def test_dataloader_workers_are_not_priced_on_a_cpu_run_and_say_why():
    """On a CPU run the workers' start-up and batch transfer share the step's cores, which the
    replay does not time: the change is listed with why, never timed; on a GPU it is priced."""
    from probes.replay.step_changes import WORKERS_ON_CPU, not_measured, step_changes_for
    from probes.step.changes import StepConfig

    base = StepConfig(False, "sdpa", None, 0)  # a trainer collating in its own loop
    training = SimpleNamespace(micro_batch_size=2, grad_accum=8)
    on_cpu = {c.strategy for c in step_changes_for(base, training, cpu_only=True)}
    on_gpu = {c.strategy for c in step_changes_for(base, training, cpu_only=False)}
    assert "dataloader_workers_2" in on_gpu and "dataloader_workers_2" not in on_cpu
    assert on_gpu - on_cpu == {"dataloader_workers_2"}
    step = SimpleNamespace(trainer=None, harness=None)
    assert not_measured(step, True, base)["dataloader_workers_2"] == WORKERS_ON_CPU
    assert "dataloader_workers_2" not in not_measured(step, False, base)
