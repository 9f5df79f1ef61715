"""Step-level changes: what changes the training step itself rather than the order of the data.

Each is a replay strategy on the same footing as the batching ones (same estimator, intervals,
coverage control): its micro-batches are the baseline's (or, for the micro-batch size, the
trainer's own random order at the new size, tokens per update kept) and its step is the user's
step with one setting changed, applied the way the trainer applies it:

- gradient (activation) checkpointing on/off (the user's setting is the baseline): the model's
  own ``activation_checkpointing_enable`` / ``_disable`` as ``Trainer.train()`` calls it (its
  kwargs from the args), with ``enable_input_require_grads`` for adapters (what TRL/peft do);
  the trainer's args follow so its own loop keeps the setting;
- the attention implementation (eager, sdpa; flash/flex where the device has them): the
  model's ``set_attn_implementation``;
- the micro-batch size at equal tokens per update: ``per_device_train_batch_size`` doubled,
  ``gradient_accumulation_steps`` halved;
- the loss kernel (stock vs chunked) where the harness's ``configure`` sets it
  (probes.step.loss_changes, which also says why a trainer's is not priced);
- padding-free per attention implementation, only where the mask gate keeps documents apart
  (probes.step.padding_free);
- a trainer's dataloader workers (``dataloader_num_workers`` 0 -> ``DATALOADER_WORKERS``): its
  loop then fetches and collates in worker processes, so a timed micro-batch leaves the
  collation out (probes.replay.timing: ``collates_in_loop``); what it does not price is the
  workers' contention for the cores the step runs on (a CPU run) and their start-up.

Each carries the settings it pastes (TrainingArguments / SFTConfig fields, model kwargs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

# the types a step-level change is made of live in their own module (the loss-kernel and
# padding-free changes and the mask gate use them without importing this one)
from probes.step.change_types import (
    GPU_ONLY_ATTENTION,
    PORTABLE_ATTENTION,
    StepChange,
    StepConfig,
)

GC_ON, GC_OFF = "gradient_checkpointing_on", "gradient_checkpointing_off"
ATTENTION_PREFIX = "attention_"
MICRO_BATCH_PREFIX = "micro_batch_size_"
WORKERS_PREFIX = "dataloader_workers_"
# workers priced against none: collation off the step needs one; a second keeps up with a step
# shorter than two collations (cruijff_kit#514 measured 0 -> 2 workers, -6% an epoch)
DATALOADER_WORKERS = 2
# the key a trainer's recorded step (config_record) goes under in a stage's provenance
RECORD_KEY = "step_config"


def checkpointing_field() -> str:
    """The installed TrainingArguments' name for it (transformers 5 renamed
    ``gradient_checkpointing`` to ``activation_checkpointing``, keeping the old one deprecated)."""
    import transformers

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )


def is_checkpointing(base: Any) -> bool:
    """The installed name first: reading the old one warns (deprecated in transformers 5)."""
    if hasattr(type(base), "is_activation_checkpointing"):
        return bool(base.is_activation_checkpointing)
    return bool(getattr(base, "is_gradient_checkpointing", False))


def current_config(model: Any, args: Any = None) -> StepConfig:
    """The step as the model (and the trainer's args: its loss_type, its dataloader workers)
    are set now."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    gc = is_checkpointing(base)
    if args is not None and getattr(args, checkpointing_field(), False):
        gc = True
    from probes.step.loss_changes import args_loss

    workers = getattr(args, "dataloader_num_workers", None)  # None: no trainer loop to set
    loss = None if args is None else args_loss(args)  # a TRL SFTConfig's loss_type
    attention = str(getattr(base.config, "_attn_implementation", None) or "eager")
    return StepConfig(gc, attention, loss, None if workers is None else int(workers))


def config_record(model: Any, args: Any = None) -> dict[str, Any]:
    """``current_config`` as JSON, for a stage that builds the user's trainer to record (under
    ``RECORD_KEY``) for one that does not build it (the memory stage reads it back)."""
    return dataclasses.asdict(current_config(model, args))


def from_record(record: Mapping[str, Any]) -> StepConfig:
    return StepConfig(**record)


def step_changes(base: StepConfig, micro: int, grad_accum: int) -> list[StepChange]:
    """The step-level changes to price against `base`: checkpointing flipped, each other
    portable attention implementation, and the micro-batch size doubled where grad_accum halves."""
    flipped = not base.gradient_checkpointing
    changes = [
        StepChange(
            GC_ON if flipped else GC_OFF,
            f"gradient checkpointing {'on' if flipped else 'off'}",
            dataclasses.replace(base, gradient_checkpointing=flipped),
            {checkpointing_field(): flipped},
        )
    ]
    for name in PORTABLE_ATTENTION:
        if name != base.attn_implementation:
            changes.append(
                StepChange(
                    ATTENTION_PREFIX + name,
                    f"attention implementation {name}",
                    dataclasses.replace(base, attn_implementation=name),
                    # from_pretrained's kwarg (probes.trainer.model_kwargs; recommendations.json's
                    # model_kwargs)
                    {"attn_implementation": name},
                )
            )
    if grad_accum % 2 == 0:
        changes.append(
            StepChange(
                f"{MICRO_BATCH_PREFIX}{2 * micro}",
                f"micro-batch size {2 * micro} at gradient accumulation {grad_accum // 2}",
                base,
                {
                    "per_device_train_batch_size": 2 * micro,
                    "gradient_accumulation_steps": grad_accum // 2,
                },
                2 * micro,
                grad_accum // 2,
            )
        )
    from probes.step import loss_changes, padding_free

    return (
        changes
        + loss_changes.loss_step_changes(base)
        + padding_free.padding_free_changes(base, PORTABLE_ATTENTION)
        + workers_changes(base)
    )


def workers_changes(base: StepConfig) -> list[StepChange]:
    """Dataloader workers where the trainer's loop collates in its own process (0 workers);
    none on the harness path (its step builds its micro-batches: not a setting)."""
    if base.dataloader_num_workers != 0:
        return []
    n = DATALOADER_WORKERS
    return [
        StepChange(
            f"{WORKERS_PREFIX}{n}",
            f"dataloader_num_workers {n} (fetch and collate beside the step)",
            dataclasses.replace(base, dataloader_num_workers=n),
            {"dataloader_num_workers": n},
        )
    ]


def gpu_only(device_type: str) -> list[str]:
    """What cannot be measured on this device: listed, never priced."""
    from probes.step import padding_free
    from probes.step.loss_changes import GPU_ONLY_LOSSES, LOSS_PREFIX

    if device_type == "cuda":
        return []
    return (
        [ATTENTION_PREFIX + n for n in GPU_ONLY_ATTENTION]
        + [LOSS_PREFIX + n for n in GPU_ONLY_LOSSES]
        + padding_free.names(GPU_ONLY_ATTENTION)
    )


def enable_checkpointing(base: Any, args: Any = None) -> None:
    """As ``Trainer.train()`` turns it on (transformers 5.24): its kwargs from the args, with
    ``every_n_layers`` and ``offload`` taken out; adapters get input gradients (peft/TRL)."""
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None,
            every_n_layers=every_n_layers,
            offload=offload,
        )
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    # frozen embeddings under adapters; transformers' enable above may have hooked them already,
    # and a second call replaces its handles, leaking a hook that disabling never removes (the
    # embeddings' outputs kept requiring gradients after checkpointing was turned off again)
    if hasattr(base, "enable_input_require_grads") and not input_grads_hooked(base):
        base.enable_input_require_grads()


def input_grads_hooked(base: Any) -> bool:
    """Whether transformers' enable_input_require_grads hooks are on the (base) model."""
    return bool(getattr(base, "_require_grads_hooks", None))


def apply_config(model: Any, config: StepConfig, args: Any = None) -> None:
    """Set the step as `config` says, the way the trainer and the model set it themselves."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if is_checkpointing(base) != config.gradient_checkpointing:
        if config.gradient_checkpointing:
            enable_checkpointing(base, args)
        elif hasattr(base, "activation_checkpointing_disable"):
            base.activation_checkpointing_disable()
        else:
            base.gradient_checkpointing_disable()
    if args is not None:  # the trainer's own loop (realize) keeps the setting
        setattr(args, checkpointing_field(), config.gradient_checkpointing)
        if config.dataloader_num_workers is not None:  # TrainerStep.collates_in_loop reads it
            args.dataloader_num_workers = config.dataloader_num_workers
    current = getattr(base.config, "_attn_implementation", None)
    if current != config.attn_implementation:
        base.set_attn_implementation(config.attn_implementation)


def change_plans(
    plans: pd.DataFrame, changes: Sequence[StepChange], micro_plans: Mapping[str, pd.DataFrame]
) -> pd.DataFrame:
    """The plan rows of every step-level change: the baseline's micro-batches under the
    change's name, or (micro-batch size) the new size's random plan from `micro_plans`, or
    (padding-free) the baseline's micro-batches each flattened into one row."""
    from probes.batching.plans import BASELINE
    from probes.step import padding_free

    base = plans[plans["strategy"] == BASELINE]
    frames = []
    for change in changes:
        source = micro_plans[change.strategy] if change.micro_batch_size else base
        if padding_free.is_padding_free(change.strategy):
            source = padding_free.flattened(base)
        frames.append(source.assign(strategy=change.strategy))
    return pd.concat(frames, ignore_index=True) if frames else plans.iloc[0:0]


def title_of(name: str) -> str | None:
    """A step-level change in the Summary's words (None for any other strategy)."""
    if name in (GC_ON, GC_OFF):
        return f"Turn gradient checkpointing {'on' if name == GC_ON else 'off'}"
    if name.startswith(ATTENTION_PREFIX):
        return f"Use the {name[len(ATTENTION_PREFIX) :]} attention implementation"
    if name.startswith(MICRO_BATCH_PREFIX):
        size = name[len(MICRO_BATCH_PREFIX) :]
        return f"Micro-batch size {size} at the same tokens per update"
    if name.startswith(WORKERS_PREFIX):
        return f"Fetch and collate in {name[len(WORKERS_PREFIX) :]} dataloader workers"
    from probes.step import loss_changes, padding_free

    return loss_changes.title_of(name) or padding_free.title_of(name)


def is_step_change(name: str) -> bool:
    from probes.step.loss_changes import LOSS_PREFIX
    from probes.step.padding_free import PADDING_FREE_PREFIX

    return name in (GC_ON, GC_OFF) or name.startswith(
        (ATTENTION_PREFIX, MICRO_BATCH_PREFIX, LOSS_PREFIX, PADDING_FREE_PREFIX, WORKERS_PREFIX)
    )


def plan_shapes(names: Sequence[str], micro: int, grad_accum: int) -> list[StepChange]:
    """Step-level changes named by the replay, for their plans alone (their steps need the
    loaded model: StepSwitch): the micro-batch size read from the name, tokens per update kept."""
    out = []
    for name in names:
        if not is_step_change(name):
            continue
        size = int(name[len(MICRO_BATCH_PREFIX) :]) if name.startswith(MICRO_BATCH_PREFIX) else None
        accum = micro * grad_accum // size if size else None
        out.append(StepChange(name, name, StepConfig(False, ""), {}, size, accum))
    return out


class StepSwitch:
    """Sets the loaded step for each strategy as it is timed: a step-level change's config for
    its strategy, the base config for every other (a setting changes only when it differs)."""

    def __init__(self, runner: Any, changes: Sequence[StepChange] = ()) -> None:
        from probes.step import loss_changes

        self.runner = runner
        self.args = getattr(getattr(runner, "trainer", None), "args", None)
        self.base = dataclasses.replace(
            current_config(runner.model, self.args), loss=loss_changes.current_loss(runner)
        )
        self.current = self.base
        self.configs = {c.strategy: c.config for c in changes}

    def set(self, strategy: str | None) -> StepConfig:
        config = self.configs.get(str(strategy), self.base)
        if config != self.current:
            apply_config(self.runner.model, config, self.args)
            if config.loss != self.current.loss:
                from probes.step import loss_changes

                loss_changes.apply_loss(self.runner, config.loss)
            self.current = config
        return config


def micro_batch_plans(
    changes: Sequence[StepChange], examples: Any, max_len: int, seed: int
) -> dict[str, pd.DataFrame]:
    """The random plan at each micro-batch-size change's size (the trainer's own order)."""
    from probes.batching import plans as pl

    out = {}
    for change in changes:
        if change.micro_batch_size:
            built = pl.build_plans(
                examples, change.micro_batch_size, change.grad_accum, max_len, 1, seed=seed
            )
            out[change.strategy] = built[built["strategy"] == pl.BASELINE]
    return out
