"""The trainer's ``optim`` alternatives: which the installed libraries can build, and why the
replay lists rather than prices them.

transformers names its optimizers in ``OptimizerNames``; an alternative is offered where the
backend it needs is importable here (the fused and plain torch AdamW always; the 8-bit ones
with bitsandbytes or torchao). The replay times the optimizer step once for every strategy
(probes.replay.timing.time_optimizer_step, one array its estimator shares), so a change that
alters only the optimizer step would come out at zero saving: it is listed with why until the
estimator times the optimizer step per strategy.
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
NOT_TIMED = (
    "not timed: the replay times the optimizer step once for every strategy (its estimator "
    "prices micro-batches), so an optimizer change would read as no saving; pricing it needs "
    "the optimizer step timed per strategy"
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
