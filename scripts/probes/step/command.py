"""``trainer.command``: the command the user already runs, probed as it is.

``trainer.command: [trl, sft, --model_name_or_path, ...]`` (or one string, split as a shell
splits it). The command runs in this process under probes.step.intercept: the workflow's settings
reach every TrainingArguments / SFTConfig it builds and every model it loads, and its
``trainer.train()`` hands the built trainer back instead of training; its code after ``train()``
(saving, pushing, ending trackers) never runs. What it can be:

- ``python [-m module | script.py] args...`` or ``script.py args...``: a script run as
  ``__main__`` (code at top level, argparse, no function to import);
- a console script installed in this environment (``trl sft ...``, ``accelerate launch
  script.py ...``): its entry point; a launcher's new process is this one (intercept).

Bad commands end in one CommandError naming the command and where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from probes.step.factory import FactoryError, checked, file_digest

COMMAND_KEY = "trainer.command"
DEFAULT_TIMEOUT_S = 900.0
PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?$")
MULTI_PROCESS = ("torchrun", "deepspeed", "mpirun", "srun")
SECRET_FLAG = re.compile(r"token|key|secret|password|passwd|auth|credential", re.IGNORECASE)
SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|xox[bp]-)[A-Za-z0-9_-]{8,}")
HIDDEN = "***"


class CommandError(FactoryError):
    """The command cannot be run, or ended without handing over a trainer at ``train()``."""


class CommandTimeout(BaseException):  # noqa: N818 - a stop signal, raised by the timer
    pass


@dataclasses.dataclass(frozen=True)
class Entry:
    """What runs: ``kind`` "file" (a script), "module" (``python -m``) or "script" (a console
    script's entry point), its target, and the arguments it sees as ``sys.argv[1:]``."""

    kind: str
    target: str
    args: tuple[str, ...]


def command_argv(value: Any) -> list[str]:
    """The command as a list: a string is split as a POSIX shell splits it."""
    if isinstance(value, str):
        return shlex.split(value)
    return [str(part) for part in value]


def python_entry(rest: Sequence[str]) -> Entry | None:
    """``python``'s own flags skipped (``-u``, ``-O``, ``-B``...); then ``-m mod`` or a file."""
    rest = list(rest)
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return Entry("module", rest[1], tuple(rest[2:]))
    if rest and rest[0] != "-c":
        return Entry("file", rest[0], tuple(rest[1:]))
    return None


@functools.cache
def console_script(name: str) -> importlib.metadata.EntryPoint | None:
    """The installed console script `name` (what a shell would run). Once per process: each
    lookup scans every installed distribution's metadata, and a build asks three times."""
    found = importlib.metadata.entry_points(group="console_scripts", name=name)
    return next(iter(found), None)


def entry_of(argv: Sequence[str]) -> Entry | None:
    """What the command runs; None where it is none of the kinds this module runs."""
    if not argv:
        return None
    head, name = argv[0], os.path.basename(argv[0])
    if PYTHON.match(name) or os.path.abspath(head) == os.path.abspath(sys.executable):
        return python_entry(argv[1:])
    if head.endswith(".py"):
        return Entry("file", head, tuple(argv[1:]))
    if name not in MULTI_PROCESS and console_script(name) is not None:
        return Entry("script", name, tuple(argv[1:]))
    return None


def shown(argv: Sequence[str]) -> str:
    """The command as messages and the report show it: a value after a flag that names a
    token, key or secret, or one that looks like a token, hidden; a path cut to its last part."""
    out: list[str] = []
    for index, part in enumerate(argv):
        before = argv[index - 1] if index else ""
        flag, sep, value = part.partition("=") if part.startswith("-") else ("", "", part)
        secret = SECRET_FLAG.search(flag) or (
            not flag and before.startswith("-") and SECRET_FLAG.search(before)
        )
        if (sep or not flag) and (secret or SECRET_VALUE.match(value)):
            value = HIDDEN
        elif (sep or not flag) and "/" in value.strip("/"):
            value = ".../" + value.rstrip("/").rsplit("/", 1)[-1]
        out.append(f"{flag}{sep}{value}" if flag else value)
    return shlex.join(out)


def static_problem(value: Any, base: Path) -> str | None:
    """What is visibly wrong with ``trainer.command`` without running it (parse time)."""
    argv = command_argv(value)
    if not argv:
        return f"{COMMAND_KEY}: empty; give the command you train with, e.g. [trl, sft, ...]."
    entry = entry_of(argv)
    if entry is None:
        return f"{COMMAND_KEY} '{shown(argv)}': {unrunnable(argv)}"
    if entry.kind == "file" and not (base / entry.target).is_file():
        return (
            f"{COMMAND_KEY} '{shown(argv)}': script '{entry.target}' does not exist (a relative "
            f"path starts at the working directory {base})."
        )
    if entry.kind == "module" and importlib.util.find_spec(entry.target.split(".")[0]) is None:
        return f"{COMMAND_KEY} '{shown(argv)}': no module '{entry.target}' on this Python path."
    return None


def unrunnable(argv: Sequence[str]) -> str:
    name = os.path.basename(argv[0])
    if name in MULTI_PROCESS:
        return (
            f"'{name}' starts several processes; give the command one process runs (e.g. "
            "'python train.py ...' or 'accelerate launch train.py ...')."
        )
    return (
        f"'{argv[0]}' is neither python, a .py script nor a console script installed in this "
        "environment; give 'python train.py ...', 'python -m package.module ...' or an "
        "installed command such as 'trl sft ...'."
    )


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """CommandTimeout after `seconds` (a SIGALRM timer; only in the main thread)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise CommandTimeout()

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def last_frame(error: BaseException, own_file: str = "") -> str:
    """The traceback's last frame, and where it raised in the command's own file (`own_file`)
    when that frame is in a library: the line the user can change."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    said = f"last frame: {frame.filename}:{frame.lineno} in {frame.name}"
    own = os.path.realpath(own_file) if own_file else None
    mine = [f for f in frames if own and os.path.realpath(f.filename) == own]
    if mine and mine[-1] is not frame:
        said += f"; in the command's own {Path(own_file).name}: line {mine[-1].lineno}"
    return f" ({said})"


@dataclasses.dataclass(frozen=True)
class Command:
    """``trainer.command`` as a probes.step.source.TrainerSource."""

    argv: tuple[str, ...]
    timeout_s: float = DEFAULT_TIMEOUT_S
    key = COMMAND_KEY
    kind = "command"

    @classmethod
    def of(cls, value: Any, timeout_s: float | None = None) -> Command:
        argv = tuple(command_argv(value))
        problem = static_problem(argv, Path.cwd())
        if problem:
            raise CommandError(problem)
        return cls(argv, float(timeout_s or DEFAULT_TIMEOUT_S))

    @property
    def spec(self) -> str:
        return shown(self.argv)

    @property
    def entry(self) -> Entry:
        entry = entry_of(self.argv)
        assert entry is not None  # checked in of()
        return entry

    @property
    def source_file(self) -> str:
        entry = self.entry
        if entry.kind == "file":
            return entry.target
        # a launcher's training script (accelerate launch train.py): the user's own file
        script = next((a for a in entry.args if a.endswith(".py") and Path(a).is_file()), None)
        if script:
            return script
        module = entry.target if entry.kind == "module" else console_script(entry.target).module
        found = importlib.util.find_spec(module)
        return str(found.origin) if found and found.origin else ""

    def describe(self) -> dict[str, Any]:
        entry = self.entry
        described = {"spec": self.spec, "entry": entry.kind, **file_digest(self.source_file)}
        if entry.kind == "script":
            point = console_script(entry.target)
            described["entry_point"] = point.value
            dist = getattr(point, "dist", None)
            described["package"] = f"{dist.name} {dist.version}" if dist else None
        return described

    def fail(self, what: str) -> CommandError:
        return CommandError(f"{COMMAND_KEY} '{self.spec}': {what}")

    def build(self, settings: Mapping[str, Any]) -> Any:
        """The trainer the command builds with `settings`, taken at its ``train()``."""
        from probes.step.intercept import intercepting

        with intercepting(settings) as capture:
            ending = self.run_intercepted()
        for trainer in capture.trainers:
            vars(trainer).pop("train", None)  # its own train() again: realize runs its loop
        if capture.train_calls > 1:
            raise self.fail(
                f"train() was called {capture.train_calls} times (the command caught the "
                "probes' stop at the first call and went on); probe a command that trains once."
            )
        if capture.taken is None:
            raise self.fail(self.no_trainer(ending, len(capture.trainers)))
        return checked(capture.taken, COMMAND_KEY, self.spec)

    def no_trainer(self, ending: str, constructed: int) -> str:
        what = (
            "constructed no transformers.Trainer"
            if not constructed
            else f"constructed {constructed} Trainer(s) and called train() on none"
        )
        return (
            f"it {ending} before train(): it {what}. The probes take the trainer when the "
            "command calls trainer.train(); run the command by hand to check it reaches training."
        )

    def run_intercepted(self) -> str:
        """Run the command to its ``train()``: "" where it got there, else how it ended."""
        from probes.step.intercept import TrainerTaken

        try:
            with time_limit(self.timeout_s):
                code = self.run_entry()
        except TrainerTaken:
            return ""
        except CommandTimeout:
            raise self.fail(
                f"still running after {self.timeout_s:.0f} s without calling train(); stopped. "
                "Raise trainer.command_timeout_s if building the trainer takes longer, or check "
                "what it waits for."
            ) from None
        except SystemExit as stop:
            return f"exited (code {stop.code if stop.code is not None else 0})"
        except Exception as error:
            raise self.fail(self.raised(error)) from error
        return "ran to its end" if code is None else f"returned {code!r}"

    def raised(self, error: BaseException) -> str:
        text = f"{type(error).__name__}: {error}"
        hint = "Fix the command (run it by hand to reproduce)."
        if re.search(r"offline|connect|internet|resolve|hub", str(error), re.IGNORECASE):
            hint = "The probes run it offline: give local paths for the model and the data."
        elif re.search(r"cuda|gpu|device|nccl", str(error), re.IGNORECASE):
            hint = "It asked for a device the probes do not give it here; see docs/command.md."
        return f"it raised {text}{last_frame(error, self.source_file)}. {hint}"

    def run_entry(self) -> Any:
        from probes.step.intercept import run_entry_file, run_entry_module

        entry = self.entry
        if entry.kind == "file":
            return run_entry_file(entry.target, list(entry.args))
        if entry.kind == "module":
            return run_entry_module(entry.target, list(entry.args))
        main = console_script(entry.target).load()
        from probes.step.intercept import process_state

        with process_state([entry.target, *entry.args], None):
            return main()
