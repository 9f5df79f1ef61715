"""The loss kernel as a step-level change (probes.step.changes registers it).

What the installed libraries offer to set it, and so what is priced:

- a harness whose ``configure`` takes ``loss_kernel`` (its ``LOSS_KERNELS`` attribute, the
  reference harness's ``("chunked", "stock")``): the other kernel is priced on the baseline's
  micro-batches, flipped between timed micro-batches through the harness's own ``configure``
  (the run's options with ``loss_kernel`` changed); what it pastes is that harness option;
- a TRL SFTTrainer whose ``loss_type`` offers more than one value its step computes
  (``trl_loss_types``: SFTConfig's choices that ``SFTTrainer.compute_loss`` names; TRL 1.16:
  ``nll``, ``dft``): each other value is priced, set on the trainer's args between timed
  micro-batches (its compute_loss reads ``args.loss_type`` every call); it pastes ``loss_type``;
- the loss kernel of a user's trainer: not priced, and the record says why. transformers'
  Trainer has no loss-kernel setting (its model computes the full logits and its loss from them;
  ``compute_loss_func`` receives those logits already built), so a chunked loss there is code the
  user writes; TRL's SFTTrainer (1.16) always computes the loss through its own fused, chunked
  LM head (``trl.trainer.utils.add_fused_lm_head``), and reaches the full logits only through
  deprecated paths that add a forward pass (``compute_loss_func``, ``label_smoothing_factor``);
- Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy are Triton (GPU) kernels:
  "GPU only: not measured on this device" elsewhere; on a GPU they are not priced yet (TRL 1.16's
  SFTTrainer refuses Liger's fused linear cross-entropy and deprecates ``use_liger_kernel``;
  CCE is a model patch, code the user adds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from probes.step.change_types import StepChange, StepConfig

LOSS_PREFIX = "loss_"
LOSS_OPTION = "loss_kernel"  # the harness option (configure) that selects it
LOSS_KERNELS_ATTRIBUTE = "LOSS_KERNELS"  # the harness module's kernels, its default first
CHUNKED, STOCK = "chunked", "stock"
PORTABLE_LOSSES = (CHUNKED, STOCK)  # run on any device
LIGER, CCE = "liger_fused_linear_cross_entropy", "cut_cross_entropy"
GPU_ONLY_LOSSES = (LIGER, CCE)
TRL_LOSS_FIELD = "loss_type"  # SFTConfig's; read by SFTTrainer.compute_loss every call
TRL_LOSS_TITLES = {
    "nll": "TRL loss_type 'nll' (the token-mean negative log-likelihood, TRL's default)",
    "dft": "TRL loss_type 'dft' (Dynamic Fine-Tuning: each token's loss weighted by its "
    "probability; a different objective, priced for its step time only)",
}
TITLES = {
    CHUNKED: "chunked linear cross-entropy (the head on the loss positions, never the full logits)",
    STOCK: "stock loss (full logits over every position, then the model's own loss)",
    LIGER: "Liger's fused linear cross-entropy",
    CCE: "Cut Cross-Entropy (Apple)",
}


def harness_kernels(runner: Any) -> tuple[str, ...]:
    """The loss kernels the runner's harness takes under ``loss_kernel`` (its LOSS_KERNELS),
    () where it cannot be flipped: a trainer, a harness without them, without ``configure``, or
    a runner that did not record the options it was configured with."""
    harness = getattr(runner, "harness", None)
    if harness is None or harness.hook("configure") is None:
        return ()
    if "options" not in getattr(runner, "described", {}):
        return ()
    return tuple(getattr(harness.module, LOSS_KERNELS_ATTRIBUTE, ()))


def trl_loss_types() -> tuple[str, ...]:
    """SFTConfig's ``loss_type`` choices that the installed SFTTrainer's ``compute_loss``
    computes (a choice it never names trains as the default: TRL 1.16 lists ``chunked_nll`` and
    refuses it at construction), the default first; () without TRL or the field."""
    import inspect

    try:
        import trl
    except ImportError:
        return ()
    field = next((f for f in dataclasses.fields(trl.SFTConfig) if f.name == TRL_LOSS_FIELD), None)
    if field is None or not field.metadata.get("choices"):
        return ()
    source = inspect.getsource(trl.SFTTrainer.compute_loss)
    named = [str(c) for c in field.metadata["choices"] if repr(str(c)) in source.replace('"', "'")]
    default = str(field.default)
    return (default, *[c for c in named if c != default])


def trainer_loss(trainer: Any) -> str | None:
    """The TRL SFTTrainer's loss_type where it has more than one to price, else None."""
    if not is_fused_sft_trainer(trainer):
        return None
    return args_loss(getattr(trainer, "args", None))


def args_loss(args: Any) -> str | None:
    """SFTConfig args' loss_type where the installed TRL prices more than one, else None (the
    record a stage that does not build the trainer reads: probes.step.changes.config_record)."""
    value = getattr(args, TRL_LOSS_FIELD, None)
    types = trl_loss_types() if value is not None else ()
    return str(value) if value in types and len(types) > 1 else None


def current_loss(runner: Any) -> str | None:
    """The loss the runner's step computes now: the harness's kernel, or a TRL SFTTrainer's
    loss_type (None: not a setting of this step)."""
    trainer = getattr(runner, "trainer", None)
    if trainer is not None:
        return trainer_loss(trainer)
    kernels = harness_kernels(runner)
    if not set(PORTABLE_LOSSES) <= set(kernels):
        return None
    return str(runner.described["options"].get(LOSS_OPTION, kernels[0]))


def apply_loss(runner: Any, kernel: str | None) -> None:
    """Set the step's loss: a trainer's loss_type on its args (compute_loss reads it each call),
    else the harness's kernel the way the harness is configured: its ``configure`` with the run's
    own options and ``loss_kernel`` changed (configure resets to its defaults first)."""
    if kernel is None:
        return
    trainer = getattr(runner, "trainer", None)
    if trainer is not None:
        setattr(trainer.args, TRL_LOSS_FIELD, kernel)
        return
    runner.harness.hook("configure")({**runner.described["options"], LOSS_OPTION: kernel})


def loss_step_changes(base: StepConfig) -> list[StepChange]:
    """Each other loss of the base's kind: the harness's portable kernels, or TRL's loss_types
    (trl_loss_types), where the loss is a setting of the step."""
    if base.loss is None:
        return []
    if base.loss in PORTABLE_LOSSES:
        return [
            StepChange(
                LOSS_PREFIX + kernel,
                f"loss kernel: {TITLES[kernel]}",
                dataclasses.replace(base, loss=kernel),
                # what pastes: the harness option, as profile.harness_options carries it
                {"harness_options": {LOSS_OPTION: kernel}},
            )
            for kernel in PORTABLE_LOSSES
            if kernel != base.loss
        ]
    return [
        StepChange(
            LOSS_PREFIX + value,
            TRL_LOSS_TITLES.get(value, f"TRL loss_type {value!r}"),
            dataclasses.replace(base, loss=value),
            {TRL_LOSS_FIELD: value},  # an SFTConfig field (probes.apply.changes)
        )
        for value in trl_loss_types()
        if value != base.loss
    ]


def title_of(name: str) -> str | None:
    if not name.startswith(LOSS_PREFIX):
        return None
    kernel = name[len(LOSS_PREFIX) :]
    if kernel in TRL_LOSS_TITLES:
        return f"Use {TRL_LOSS_TITLES[kernel]}"
    return f"Use the {TITLES.get(kernel, kernel)}"


def unpriced_losses(runner: Any, device_type: str) -> dict[str, str]:
    """The loss kernels not priced on this step, each with why, beside what this device cannot
    run (probes.step.changes.gpu_only lists the GPU-only kernels elsewhere than on a GPU)."""
    out = {}
    if device_type == "cuda":
        out = {LOSS_PREFIX + kernel: gpu_reason(kernel) for kernel in GPU_ONLY_LOSSES}
    trainer = getattr(runner, "trainer", None)
    if trainer is not None:
        out[LOSS_PREFIX + CHUNKED] = trainer_reason(trainer)
    elif current_loss(runner) is None:
        out[LOSS_PREFIX + CHUNKED] = (
            f"not a setting of this harness: its configure takes no {LOSS_OPTION!r} with "
            f"{list(PORTABLE_LOSSES)} (module attribute {LOSS_KERNELS_ATTRIBUTE}); the harness's "
            "own compute_loss is what is timed"
        )
    return out


def gpu_reason(kernel: str) -> str:
    if kernel == LIGER:
        return (
            "not priced yet: Liger's fused linear cross-entropy replaces the model's forward when "
            "the trainer is built (TrainingArguments use_liger_kernel), so it cannot be flipped "
            "between timed micro-batches; TRL 1.16's SFTTrainer refuses it and deprecates "
            "use_liger_kernel (a FutureWarning: its Hub kernels instead)"
        )
    return "not priced yet: Cut Cross-Entropy is a model patch (cut_cross_entropy), code you add"


def trainer_reason(trainer: Any) -> str:
    """Why a trainer's loss kernel is not priced: already chunked (TRL's SFTTrainer), or code
    the user must write (transformers' Trainer)."""
    import transformers

    if is_fused_sft_trainer(trainer):
        import trl

        return (
            f"not priced: trl {trl.__version__}'s SFTTrainer already computes the loss chunked, "
            "through its fused LM head (trl.trainer.utils.add_fused_lm_head: never the full "
            "logits), and no setting turns it off but deprecated ones that add a forward pass "
            "(compute_loss_func, label_smoothing_factor)"
        )
    return (
        f"not priced: needs code you write. transformers {transformers.__version__}'s "
        f"{type(trainer).__name__} computes the full logits in the model's forward and its loss "
        "from them; no TrainingArguments field or model kwarg chunks it (compute_loss_func "
        "receives the logits already built). Override compute_loss to run the decoder and a "
        "chunked head (TRL's SFTTrainer does: trl.trainer.utils.add_fused_lm_head)"
    )


def is_fused_sft_trainer(trainer: Any) -> bool:
    """A TRL SFTTrainer of a version that adds its fused LM head (TRL >= 1.x)."""
    try:
        import trl
        from trl.trainer import utils as trl_utils
    except ImportError:
        return False
    return isinstance(trainer, trl.SFTTrainer) and hasattr(trl_utils, "add_fused_lm_head")
