"""Where the user's trainer comes from: the one interface every stage builds a trainer through.

Two sources, one shape (``TrainerSource``): ``trainer.factory`` (probes.step.factory: a function
``build_trainer(settings)``) and ``trainer.command`` (probes.step.command: the command the user
runs, its trainer taken at ``train()``). ``build(settings)`` gives a checked Trainer with the
settings applied; ``describe()`` says what it was built from. The stages call
``trainer_source(cfg.trainer)`` and never ask which kind it is.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from probes.step.command import COMMAND_KEY
from probes.step.factory import FACTORY_KEY, FactoryError

OUTPUT_PREFIX = "probes-trainer-"


class TrainerSource(Protocol):
    key: str  # the config key it came from: trainer.factory or trainer.command
    kind: str  # "factory" or "command": the provenance's key for describe()

    @property
    def spec(self) -> str:
        """What the user gave, as messages and the report show it (secrets hidden)."""

    @property
    def source_file(self) -> str:
        """The user's file whose lines an error names ("" where none)."""

    def build(self, settings: Mapping[str, Any]) -> Any:
        """The Trainer, built with ``settings`` applied (probes.step.trainer.probe_settings)."""

    def describe(self) -> dict[str, Any]:
        """What it was built from, for the provenance (spec, file and its hash)."""


def given(trainer: Any) -> bool:
    """Whether the trainer section names a source (the stages' trainer mode)."""
    return bool(getattr(trainer, "factory", None) or getattr(trainer, "command", None))


def trainer_source(trainer: Any) -> TrainerSource | None:
    """The source the trainer section (TrainerConfig or its mapping) names; None: the harness."""
    get = trainer.get if isinstance(trainer, Mapping) else lambda k, d=None: getattr(trainer, k, d)
    factory, command = get("factory"), get("command")
    problem = both_problem(factory, command)
    if problem:
        raise FactoryError(problem)
    if factory:
        from probes.step.factory import load_factory

        return load_factory(str(factory))
    if command:
        from probes.step.command import Command

        return Command.of(command, get("command_timeout_s"))
    return None


def both_problem(factory: Any, command: Any) -> str | None:
    if factory and command:
        return (
            f"{FACTORY_KEY} and {COMMAND_KEY} are both set: give exactly one (the command you "
            f"run as {COMMAND_KEY}, or a build_trainer function as {FACTORY_KEY}); set the other "
            "to null."
        )
    return None


def static_problem(trainer: Mapping[str, Any], base: Path) -> str | None:
    """What is visibly wrong with the trainer section without running anything (parse time)."""
    factory, command = trainer.get("factory"), trainer.get("command")
    problem = both_problem(factory, command)
    if problem or factory:
        from probes.step.factory import static_problem as factory_problem

        return problem or factory_problem(factory, base)
    if command is not None:
        from probes.step.command import static_problem as command_problem

        return command_problem(command, base)
    return None


def source_file(trainer: Mapping[str, Any]) -> str | None:
    """The user's .py file the section names (its factory's file or its command's script):
    a Snakemake input, so an edit reruns what it built; None where there is none."""
    factory, command = trainer.get("factory"), trainer.get("command")
    if factory:
        module = str(factory).rpartition(":")[0]
        return module if module.endswith(".py") else None
    if command:
        from probes.step.command import command_argv, entry_of

        entry = entry_of(command_argv(command))
        return entry.target if entry is not None and entry.kind == "file" else None
    return None


def output_dir() -> str:
    """A folder for the trainer's ``output_dir``: nothing is written where the user's runs
    write, and it is removed when this process ends (every build cleans up after itself)."""
    path = tempfile.mkdtemp(prefix=OUTPUT_PREFIX)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
