"""The user's trainer as the probes run it (probes.step.trainer): its own prepared rows, its own
collator and dataloader order, its training_step and optimizer step; plain Trainer and
SFTTrainer on a tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trainer_factories import write_factory

from conftest import chat_rows, workflow_config, write_jsonl
from probes.batching import plans as pl
from probes.padding import trainer_rows as tr
from probes.replay.timing import ReplayRunner
from probes.step.changes import checkpointing_field
from probes.step.runner import StepRunner
from probes.step.timing import OK
from probes.step.trainer import load_trainer_step, probe_settings

MICRO = 2


@pytest.fixture(scope="module")
def factory_dir(tmp_path_factory, tiny_model_dir):
    directory = tmp_path_factory.mktemp("factories")
    data = write_jsonl(directory / "chat.jsonl", chat_rows(24))
    return directory, tiny_model_dir, data


def _step(factory_dir, kind, seed=0, rehearsal=None, extra_s=0.0):
    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, kind, micro=MICRO, extra_s=extra_s)
    settings = probe_settings(
        str(directory / "out"), torch.device("cpu"), torch.float32, None, seed
    )
    return load_trainer_step(spec, settings, rehearsal)


def _examples(step) -> pl.PlanExamples:
    lengths = tr.lengths_table(step.trainer.train_dataset, None)
    return pl.PlanExamples(
        example_ids=lengths["example_id"].to_numpy(dtype=object),
        lengths=lengths["n_tokens"].to_numpy(),
        loss_tokens=lengths["n_loss_tokens"].to_numpy(),
    )


@pytest.mark.parametrize("seed", [0, 3])
def test_the_random_plan_is_the_trainers_own_dataloader_batch_for_batch(factory_dir, seed):
    step = _step(factory_dir, "sft", seed=seed)
    plans = pl.build_plans(_examples(step), MICRO, 2, 128, 1, seed=seed)
    random = plans[plans["strategy"] == pl.BASELINE].sort_values("micro_batch_index")
    ours = [step.plan_batch(row)["input_ids"] for row in random.itertuples()]
    theirs = [batch["input_ids"] for batch in step.trainer.get_train_dataloader()]
    assert len(ours) == len(theirs) > 1
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_lengths_table_is_what_the_trainers_collator_builds(factory_dir):
    for kind in ("sft", "plain"):
        step = _step(factory_dir, kind)
        lengths = tr.lengths_table(step.trainer.train_dataset, None)
        assert lengths["example_id"].tolist() == [str(i) for i in range(len(lengths))]
        check = tr.collator_check(step.trainer, lengths, 10)
        assert check["passed"], check["observed"]
    # SFTTrainer's assistant-only labels: fewer loss tokens than tokens; the plain one: all
    sft = tr.lengths_table(_step(factory_dir, "sft").trainer.train_dataset, None)
    assert (sft["n_loss_tokens"] < sft["n_tokens"]).all()


def test_a_packed_micro_batch_is_the_padding_free_collators_one_flattened_row(factory_dir):
    step = _step(factory_dir, "sft")
    lengths = tr.lengths_table(step.trainer.train_dataset, None)
    ids = ["0", "1", "2"]
    batch = step.plan_batch(SimpleNamespace(example_ids=ids, layout=pl.PACKED))
    total = int(lengths.set_index("example_id").loc[ids, "n_tokens"].sum())
    assert batch["input_ids"].shape == (1, total)
    assert int((batch["position_ids"][0] == 0).sum()) == len(ids)  # restarts per document
    assert "attention_mask" not in batch


def test_rehearsed_rows_are_the_plans_lengths_and_keep_the_padding_stages_row_numbers(
    factory_dir,
):
    """At a CPU rehearsal (cap 16 of max_seq_len 64) a row is its rehearsal length (what the
    plans count), its tokens evenly spaced, with about its share of loss tokens."""
    full = _step(factory_dir, "sft")
    step = _step(factory_dir, "sft", rehearsal=(16, 64))
    assert len(step.dataset) == len(full.dataset)
    for i in ("1", "2", "5"):
        row, small = full.features([i])[0], step.features([i])[0]
        n = len(row["input_ids"])
        assert len(small["input_ids"]) == pl.rehearsal_length([n], 16, 64)[0]
        assert small["input_ids"][0] == row["input_ids"][0]
    batch = step.plan_batch(SimpleNamespace(example_ids=["1", "2"], layout=pl.PADDED))
    lengths = [len(full.features([i])[0]["input_ids"]) for i in ("1", "2")]
    assert batch["input_ids"].shape == (2, max(pl.rehearsal_length(lengths, 16, 64)))


def test_a_step_trains_the_adapters_through_the_trainers_optimizer_and_scheduler(factory_dir):
    for kind in ("sft", "plain"):
        step = _step(factory_dir, kind)
        trainable = [p for p in step.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in trainable]
        batches = [
            step.plan_batch(SimpleNamespace(example_ids=[str(i), str(i + 1)], layout="padded"))
            for i in (0, 2)
        ]
        step.step(batches)
        assert any(not torch.equal(a, b) for a, b in zip(before, trainable, strict=True))
        # what the report names as timed: the settings as a user writes them
        settings = step.describe()["settings"]
        assert settings["optim"] == step.trainer.args.optim.value and "." not in settings["optim"]
        assert settings["per_device_train_batch_size"] == MICRO
        # checkpointing under the installed name (the deprecated one is not what users write)
        field = checkpointing_field()
        assert settings[field] is False
        assert field == "gradient_checkpointing" or "gradient_checkpointing" not in settings
        assert step.trainer.lr_scheduler.last_epoch == 1
        assert all(p.grad is None for p in trainable)  # the loop's zero_grad


def test_the_trainers_own_compute_loss_is_what_is_timed(factory_dir):
    """A cost the trainer adds per micro-batch (the harness would not see it) is in the time."""
    extra = 0.05
    step = _step(factory_dir, "plain", extra_s=extra)
    runner = ReplayRunner(step, 0, 0, seed=0)
    row = SimpleNamespace(example_ids=["0", "1"], layout=pl.PADDED)
    timed = runner.time_micro_batch(row)
    assert timed["status"] == OK and timed["time_s"] >= extra
    assert np.isfinite(runner.time_optimizer_step())


def test_each_timed_micro_batch_is_collated_as_the_trainers_loop_collates_it(
    factory_dir, monkeypatch
):
    """The trainer's loop fetches and collates every micro-batch in its process (no dataloader
    workers): each timed run collates too. With workers, the collation overlaps the step and
    stays outside the timer; the harness's batches (the probe's own) never enter it."""
    step = _step(factory_dir, "plain")
    calls = []
    collate = step.collator
    monkeypatch.setattr(step, "collator", lambda rows: calls.append(1) or collate(rows))
    runner = ReplayRunner(step, 0, 0, seed=0)
    row = SimpleNamespace(example_ids=["0", "1"], layout=pl.PADDED)
    assert step.collates_in_loop
    assert runner.time_micro_batch(row)["status"] == OK
    assert len(calls) == 1 + 1  # the batch, then its collation inside the timed run
    calls.clear()
    step.trainer.args.dataloader_num_workers = 2
    assert not step.collates_in_loop
    runner.time_micro_batch(row)
    assert len(calls) == 1  # its batch once, outside the timer
    step.trainer.args.dataloader_num_workers = 0

    class Harnessed:  # as the harness's StepRunner: the probe's own batches, built outside
        device = torch.device("cpu")
        collates_in_loop = StepRunner.collates_in_loop
        built = 0

        def plan_batch(self, row, *args):
            self.built += 1
            return {"input_ids": torch.zeros(1, 4, dtype=torch.long)}

        def forward_backward(self, batch):
            pass

    assert StepRunner.collates_in_loop is False
    harnessed = Harnessed()
    ReplayRunner(harnessed, 0, 0, seed=0).time_micro_batch(row)
    assert harnessed.built == 1


def test_new_shapes_are_warmed_before_the_timing_so_no_unit_runs_right_after_itself(factory_dir):
    """run_sample warms a sample's new (configuration, shape)s first (warm_new_shapes): a timed
    unit then runs once, after whatever unit came before it, never right after its own warm-up."""
    import pandas as pd

    step = _step(factory_dir, "plain")
    runner = ReplayRunner(step, 0, 0, seed=0)
    sample = pd.DataFrame(
        {"example_ids": [["0", "1"], ["2", "3"], ["0", "1"]], "layout": [pl.PADDED] * 3}
    )
    shapes = {tuple(runner.device_batch(r)["input_ids"].shape) for r in sample.itertuples()}
    runs = []
    forward_backward = runner._forward_backward
    runner._forward_backward = lambda batch: runs.append(1) or forward_backward(batch)
    assert runner.warm_new_shapes(sample) == len(shapes) and len(runs) == len(shapes)
    assert runner.warm_new_shapes(sample) == 0  # nothing new the second time
    runs.clear()
    assert runner.time_micro_batch(next(sample.itertuples()))["status"] == OK
    assert len(runs) == 1  # timed once, right after whatever ran before it


def test_realize_runs_the_trainers_own_loop_for_one_step_of_the_plans_micro_batches(factory_dir):
    """StepTimer on a TrainerStep runs trainer.train() over exactly the step's micro-batches:
    the loop's callbacks mark its phases, its per-micro-batch compute_loss cost is inside."""
    from probes.realize.steps import StepTimer

    extra = 0.05
    step = _step(factory_dir, "plain", extra_s=extra)
    rows = [
        SimpleNamespace(example_ids=["0", "1"], layout=pl.PADDED),
        SimpleNamespace(example_ids=["2", "3", "4"], layout=pl.PACKED),
    ]
    timed = StepTimer(step, 0, 0, 0).time_step(rows)
    assert timed["status"] == OK
    assert timed["micro_batch_s"] >= 2 * extra  # both micro-batches ran through compute_loss
    parts = timed["micro_batch_s"] + timed["optimizer_s"] + timed["rest_s"]
    assert abs(parts - timed["time_s"]) < 1e-9
    assert step.trainer.state.global_step == 1  # one optimizer step, as the loop counts it
    assert step.trainer.args.gradient_accumulation_steps == 2  # the user's setting restored


def test_a_step_level_change_is_set_the_way_the_trainer_sets_it_and_kept_by_its_loop(
    factory_dir,
):
    from probes.realize.stage import step_switch
    from probes.realize.steps import StepTimer
    from probes.step import changes as sc

    step = _step(factory_dir, "sft")
    training = workflow_config(training={"micro_batch_size": MICRO, "grad_accum": 2}).training
    switch = step_switch(step, [sc.GC_ON, "attention_eager", pl.LENGTH_GROUPED], training)
    # TRL's loss_type and the loop's dataloader workers are settings of a trainer's step
    assert switch.base == sc.StepConfig(False, "sdpa", "nll", dataloader_num_workers=0)
    timer = StepTimer(step, 0, 0, 0)
    timer.switch = switch
    base = step.model.get_base_model()
    row = SimpleNamespace(example_ids=["0", "1"], layout=pl.PADDED, strategy=sc.GC_ON)
    assert timer.time_step([row])["status"] == OK  # trainer.train() with checkpointing on
    assert base.is_activation_checkpointing and step.trainer.args.activation_checkpointing
    eager = SimpleNamespace(example_ids=["0", "1"], layout=pl.PADDED, strategy="attention_eager")
    assert timer.time_step([eager])["status"] == OK
    assert not base.is_activation_checkpointing and base.config._attn_implementation == "eager"
    timer.configure([SimpleNamespace(strategy=pl.BASELINE)])
    assert current_config_of(step) == switch.base
    with pytest.raises(Exception, match="another base step"):
        step_switch(step, [sc.GC_OFF], training)  # the replay priced it against another base


def current_config_of(step):
    from probes.step.changes import current_config

    return current_config(step.model, step.trainer.args)


def test_load_step_keeps_the_padding_stages_rows_at_a_cpu_cap(factory_dir):
    """The rehearsal scales rows; it is not the trainer's max_length (where TRL would drop the
    rows whose loss tokens all lie past the cap, and every later row number would shift)."""
    from probes.step.load import load_step

    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, "sft", micro=MICRO)
    config = workflow_config(trainer={"factory": spec}, training={"max_seq_len": 64})
    step, *_ = load_step(config, model_dir, torch.device("cpu"), torch.float32, 8)
    full = _step(factory_dir, "sft")
    assert len(step.dataset) == len(full.dataset)
    n = len(full.features(["3"])[0]["input_ids"])
    shape = step.plan_batch(SimpleNamespace(example_ids=["3"], layout=pl.PADDED))["input_ids"]
    assert shape.shape == (1, pl.rehearsal_length([n], 8, 64)[0])


def test_the_builtin_group_by_length_plan_is_that_trainers_sampler(factory_dir):
    """recommendations.json emits train_sampling_strategy="group_by_length": the replay prices
    the order that trainer's own sampler gives for the same shuffle. (Its sampler shuffles with
    the global torch RNG, drawn after the DataLoader's own seed draw, so the test hands both the
    same generator instead of replaying the global state.)"""
    from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

    from probes.contracts import GROUP_BY_LENGTH_BUILTIN

    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, "sft", micro=MICRO)
    extra = {"train_sampling_strategy": "group_by_length"}
    settings = probe_settings(
        str(directory / "o"), torch.device("cpu"), torch.float32, None, 0, extra
    )
    step = load_trainer_step(spec, settings)
    sampler = step.trainer.get_train_dataloader().batch_sampler.sampler
    assert isinstance(sampler, LengthGroupedSampler)
    theirs = get_length_grouped_indices(
        sampler.lengths, sampler.batch_size, generator=torch.Generator().manual_seed(0)
    )
    plans = pl.build_plans(_examples(step), MICRO, 2, 128, 1, seed=0)
    grouped = plans[plans["strategy"] == GROUP_BY_LENGTH_BUILTIN].sort_values("micro_batch_index")
    ours = [int(i) for ids in grouped["example_ids"] for i in ids]
    assert ours == [int(i) for i in theirs]


@pytest.mark.parametrize(
    "strategy", ["gradient_checkpointing_on", "attention_eager", "dataloader_workers_2"]
)
def test_a_switched_step_is_the_trainer_its_change_pastes(factory_dir, strategy):
    """replay and realize switch a step-level change on the loaded trainer (StepSwitch) rather
    than building a second one: the switched trainer must be the one the factory builds from the
    change's own settings (what a user gets by pasting them): the same step setting, and the
    same loss and LoRA gradients on one batch."""
    from probes.step.changes import StepSwitch, current_config, step_changes

    switched = _step(factory_dir, "sft")
    base = current_config(switched.model, switched.trainer.args)
    change = next(c for c in step_changes(base, MICRO, 2) if c.strategy == strategy)
    StepSwitch(switched, [change]).set(strategy)
    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, "sft", micro=MICRO)
    settings = probe_settings(
        str(directory / "out"), torch.device("cpu"), torch.float32, None, 0, change.settings
    )
    rebuilt = load_trainer_step(spec, settings)
    assert current_config(rebuilt.model, rebuilt.trainer.args) == change.config
    assert current_config(switched.model, switched.trainer.args) == change.config
    rebuilt.model.load_state_dict(switched.model.state_dict())  # LoRA's random init aside
    batch = switched.collate(["0", "1"], False)
    losses = [step.forward_backward(dict(batch)) for step in (switched, rebuilt)]
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = [
        {n: p.grad for n, p in step.model.named_parameters() if p.requires_grad}
        for step in (switched, rebuilt)
    ]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], rtol=1e-4, atol=1e-6), name


def test_the_padding_stage_records_the_step_the_replay_switches_from(factory_dir):
    """The memory stage never builds the trainer: it starts its step-level changes from what the
    padding stage recorded beside the lengths, which must be the replay's StepSwitch base."""
    import dataclasses

    from probes.padding.stage import trainer_lengths
    from probes.step.changes import RECORD_KEY, StepSwitch, from_record

    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, "sft", micro=MICRO)
    config = workflow_config(
        trainer={"factory": spec},
        training={"micro_batch_size": MICRO, "grad_accum": 2, "max_seq_len": 128},
    )
    *_, source = trainer_lengths(config)
    recorded = from_record(source["trainer"][RECORD_KEY])
    base = StepSwitch(_step(factory_dir, "sft")).base
    assert recorded == dataclasses.replace(base, loss=recorded.loss)


def test_trls_loss_type_is_switched_on_the_trainers_args_as_its_setting_builds_it(factory_dir):
    """loss_dft is priced by setting the loaded SFTTrainer's args.loss_type (its compute_loss
    reads it every call): the same loss as the trainer built with loss_type='dft', and not the
    nll loss it had."""
    from probes.step.changes import StepSwitch, step_changes

    switched = _step(factory_dir, "sft")
    switch = StepSwitch(switched)
    assert switch.base.loss == "nll"
    change = next(c for c in step_changes(switch.base, MICRO, 2) if c.strategy == "loss_dft")
    assert change.settings == {"loss_type": "dft"}
    batch = switched.collate(["0", "1"], False)
    nll = switched.forward_backward(dict(batch))
    switch.configs = {change.strategy: change.config}
    switch.set(change.strategy)
    assert switched.trainer.args.loss_type == "dft"
    directory, model_dir, data = factory_dir
    spec = write_factory(directory, model_dir, data, "sft", micro=MICRO)
    settings = probe_settings(
        str(directory / "out"), torch.device("cpu"), torch.float32, None, 0, change.settings
    )
    rebuilt = load_trainer_step(spec, settings)
    rebuilt.model.load_state_dict(switched.model.state_dict())
    dft = [step.forward_backward(dict(batch)) for step in (switched, rebuilt)]
    assert torch.allclose(dft[0], dft[1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(dft[0], nll)  # a different objective: the switch took effect
    switch.set(None)
    assert switched.trainer.args.loss_type == "nll"


def test_dataloader_workers_take_the_collation_off_the_timed_micro_batch(factory_dir):
    """dataloader_workers_2 is priced by the trainer's args: its loop then collates in workers,
    so the replay's timed micro-batch leaves the collation out (collates_in_loop)."""
    from probes.step.changes import StepSwitch, step_changes

    step = _step(factory_dir, "sft")
    switch = StepSwitch(step)
    assert switch.base.dataloader_num_workers == 0 and step.collates_in_loop
    change = next(
        c for c in step_changes(switch.base, MICRO, 2) if c.strategy == "dataloader_workers_2"
    )
    switch.configs = {change.strategy: change.config}
    switch.set(change.strategy)
    assert step.trainer.args.dataloader_num_workers == 2 and not step.collates_in_loop
    switch.set(None)
    assert step.trainer.args.dataloader_num_workers == 0 and step.collates_in_loop


def test_the_optimizer_alternatives_step_the_trainers_own_parameter_groups_in_turns(factory_dir):
    """probes.step.optim: the alternative is the trainer's own create_optimizer at the other
    optim (the same parameter groups), timed in alternating turns; the trainer's optimizer and
    setting are left as they were."""
    from probes.step import optim

    step = _step(factory_dir, "sft")
    own = optim.current_optim(step.trainer.args)
    (other,) = [n for n in optim.installed_optims() if n in optim.SAME_STATE_OPTIMS and n != own]
    before = step.trainer.optimizer
    built = optim.alternative_optimizer(step.trainer, other)
    assert built is not before and step.trainer.optimizer is before
    assert optim.current_optim(step.trainer.args) == own
    sizes = [[p.numel() for p in g["params"]] for g in built.param_groups]
    assert sizes == [[p.numel() for p in g["params"]] for g in before.param_groups]
    times = optim.time_optimizers(step, step.collate(["0", "1"], False), [other], pairs=3)
    assert len(times[own]) == len(times[other]) == 3 and len(times["micro_batch_s"]) == 6
    priced = optim.price_optims(times, own, grad_accum=2)[optim.OPTIM_PREFIX + other]
    assert priced["saving_low"] <= priced["saving"] <= priced["saving_high"]
    assert priced["memory"] == optim.SAME_STATE


def test_checkpointing_is_read_by_its_current_name_without_the_deprecated_one():
    """transformers 5 warns on `is_gradient_checkpointing`; where the model has the new name the
    old one is never read (it filled every replay log with a FutureWarning)."""
    from probes.step.changes import is_checkpointing

    class Current:
        is_activation_checkpointing = False

        @property
        def is_gradient_checkpointing(self):
            raise AssertionError("the deprecated name was read")

    class Older:
        is_gradient_checkpointing = True

    assert is_checkpointing(Current()) is False and is_checkpointing(Older()) is True
