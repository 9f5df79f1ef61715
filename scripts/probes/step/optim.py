"""The trainer's ``optim`` alternatives: which the installed libraries can build, why the
replay's table lists rather than prices them, and their own paired timing (``time_optimizers``,
``price_optims``: the trainer's optimizer and each alternative stepping in alternating turns).

transformers names its optimizers in ``OptimizerNames``; an alternative is offered where the
backend it needs is importable here (the fused and plain torch AdamW always; the 8-bit ones
with bitsandbytes or torchao). The replay times the optimizer step once for every strategy
(probes.replay.timing.time_optimizer_step, one array its estimator shares), so a change that
alters only the optimizer step would come out at zero saving there: it is listed with why, and
priced beside the table by its own paired turns.
"""

from __future__ import annotations

import importlib.util
from typing import Any

OPTIM_PREFIX = "optim_"
# alternatives worth pricing against the default, with the package each needs (None: torch)
CANDIDATES = {
    "adamw_torch": None,
    "adamw_torch_fused": None,
    "adamw_8bit": "bitsandbytes",
    "adamw_torch_8bit": "torchao",
}
SAME_STATE_OPTIMS = ("adamw_torch", "adamw_torch_fused")
SAME_STATE = "the same optimizer state: two float32 moments a trainable parameter, fused or not"
NOT_TIMED = (
    "not in the replay's table: it times the optimizer step once for every strategy, so an "
    "optimizer change would read as no saving there; priced beside it instead, in turns against "
    "the trainer's own optimizer (probes.replay.step_changes.optim_record: provenance 'optim')"
)


def installed_optims() -> list[str]:
    """The candidate ``optim`` values this transformers names and whose backend imports."""
    try:
        from transformers.training_args import OptimizerNames
    except ImportError:
        return []
    named = {o.value for o in OptimizerNames}
    return [
        name
        for name, package in CANDIDATES.items()
        if name in named and (package is None or importlib.util.find_spec(package) is not None)
    ]


def current_optim(args: Any) -> str | None:
    """The trainer's ``optim`` as users write it (the enum's value), None without args."""
    optim = getattr(args, "optim", None)
    return None if optim is None else str(getattr(optim, "value", optim))


def unpriced_optims(trainer: Any) -> dict[str, str]:
    """Each installed alternative to the trainer's optimizer, with why it is not priced (none
    on the harness path: its optimizer is the harness's own)."""
    current = current_optim(getattr(trainer, "args", None)) if trainer is not None else None
    if current is None:
        return {}
    return {
        OPTIM_PREFIX + name: f"optim={name!r} against {current!r}: {NOT_TIMED}"
        for name in installed_optims()
        if name != current
    }


def alternative_optimizer(trainer: Any, name: str) -> Any:
    """The optimizer the trainer builds itself for ``optim=name`` (its own create_optimizer:
    the same parameter groups and weight decay), its own optimizer and setting left in place."""
    args, before, optim = trainer.args, trainer.optimizer, trainer.args.optim
    try:
        args.optim, trainer.optimizer = name, None
        return trainer.create_optimizer()
    finally:
        args.optim, trainer.optimizer = optim, before


def time_optimizers(step: Any, batch: Any, names: list[str], pairs: int) -> dict[str, Any]:
    """Seconds of each optimizer's step (clip at max_grad_norm, ``step()``, zero the gradients,
    as the trainer's loop does) on the same gradients' shape, the trainer's own and each of
    `names` in turns whose order alternates; each turn's micro-batch (forward + backward, not
    part of the step timed) is timed beside: {"micro_batch_s": [...], optim: [...]}."""
    import time

    from probes.step.timing import synchronize

    trainer = step.trainer
    own = current_optim(trainer.args)
    optimizers = {own: trainer.optimizer, **{n: alternative_optimizer(trainer, n) for n in names}}
    times: dict[str, Any] = {"micro_batch_s": [], **{n: [] for n in optimizers}}
    for turn in range(pairs):
        order = list(optimizers) if turn % 2 == 0 else list(reversed(optimizers))
        for name in order:
            begin = time.perf_counter()
            step.forward_backward(dict(batch))
            synchronize(step.device)
            middle = time.perf_counter()
            if trainer.args.max_grad_norm:
                trainer._clip_grad_norm(step.model)
            optimizers[name].step()
            step.model.zero_grad()
            synchronize(step.device)
            times["micro_batch_s"].append(middle - begin)
            times[name].append(time.perf_counter() - middle)
    return times


def price_optims(times: dict[str, Any], own: str, grad_accum: int) -> dict[str, Any]:
    """Each alternative's saving per optimizer step against `own` (median of the paired turns,
    sign-test interval: probes.step.compile.paired_saving), and as a share of a step
    (grad_accum micro-batches + the own optimizer step, medians). Memory: torch's AdamW, fused or
    not, keeps the same two moments a trainable parameter."""
    import numpy as np

    from probes.step.compile import paired_saving

    step_s = grad_accum * float(np.median(times["micro_batch_s"])) + float(np.median(times[own]))
    out = {}
    for name, alt in times.items():
        if name in ("micro_batch_s", own):
            continue
        saving, low, high = paired_saving(times[own], alt)
        out[OPTIM_PREFIX + name] = {
            "optim": name,
            "against": own,
            "step_saving_s": saving,
            "saving": saving / step_s,
            "saving_low": low / step_s,
            "saving_high": high / step_s,
            "memory": SAME_STATE
            if name in SAME_STATE_OPTIMS and own in SAME_STATE_OPTIMS
            else None,
        }
    return out
