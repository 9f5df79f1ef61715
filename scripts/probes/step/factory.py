"""The user's trainer factory: the function that builds the ``transformers.Trainer`` /
``trl.SFTTrainer`` they train with, given the settings the workflow varies.

Config key ``trainer.factory``: ``path/to/train.py:build_trainer`` or ``pkg.module:build_trainer``.
The factory takes one argument, ``settings`` (a dict), and returns a Trainer with a train dataset.
``settings`` holds TrainingArguments / SFTConfig fields (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``max_length``, ``train_sampling_strategy``, ``packing``,
``output_dir``, ``report_to``, ``save_strategy``, ``seed``...) which ``apply_settings`` writes into
the factory's own arguments object, and model keys (``MODEL_KEYS``: ``dtype``,
``attn_implementation``) the factory passes to ``from_pretrained`` (``model_kwargs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from probes.errors import ProbeError
from probes.step.harness import UnimportableFileError, find_module_spec, import_user_file

FACTORY_KEY = "trainer.factory"
MODEL_KEYS = ("dtype", "attn_implementation")
# What the workflow always sets, so a probe never writes into the user's output_dir, logs to their
# trackers or saves checkpoints (nothing the user gave is altered).
QUIET_SETTINGS = {
    "report_to": "none",
    "save_strategy": "no",
    "push_to_hub": False,
    "disable_tqdm": True,
}


class FactoryError(ProbeError, ValueError):
    """The trainer factory cannot be loaded, raised, or built something the probes cannot run."""


@dataclasses.dataclass(frozen=True)
class Factory:
    """``trainer.factory`` as a probes.step.source.TrainerSource."""

    spec: str
    function: Callable[[dict[str, Any]], Any]
    source_file: str
    key = FACTORY_KEY
    kind = "factory"

    def build(self, settings: Mapping[str, Any]) -> Any:
        return build_trainer(self, settings)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, **file_digest(self.source_file)}


def file_digest(path: str) -> dict[str, Any]:
    """The file and the first 16 hex digits of its sha256 (None where it is not a file)."""
    source = Path(path)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16] if source.is_file() else None
    return {"file": path, "file_sha256_16": digest}


def apply_settings(args: Any, settings: Mapping[str, Any]) -> Any:
    """``args`` (a TrainingArguments or SFTConfig) with the workflow's settings written in: every
    key that is one of its fields; model keys (``MODEL_KEYS``) and keys the installed class lacks
    are left for the factory (``model_kwargs``). A factory calls it on the arguments it built."""
    fields = {f.name for f in dataclasses.fields(args)}
    changes = {k: v for k, v in settings.items() if k in fields}
    return dataclasses.replace(args, **changes) if changes else args


def model_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings meant for ``from_pretrained`` (dtype, attention implementation)."""
    return {k: settings[k] for k in MODEL_KEYS if k in settings}


def split_spec(spec: str) -> tuple[str, str]:
    module, sep, name = str(spec).rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': give 'path/to/train.py:build_trainer' or "
            "'package.module:build_trainer' (a module, a colon, the function's name)."
        )
    return module, name


def _import_file(spec: str, path: Path) -> Any:
    if not path.is_file():
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': file '{path}' does not exist; give the .py file that "
            "defines your trainer factory, or an import path."
        )
    try:
        return import_user_file(path, "probes_user_factory_")
    except UnimportableFileError:
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': cannot import '{path}' as a Python module."
        ) from None
    except SyntaxError as error:
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': {path}:{error.lineno} does not parse ({error.msg}); "
            "fix the file."
        ) from error
    except Exception as error:
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': importing '{path}' raised {type(error).__name__}: "
            f"{error}{own_line(error, str(path))}."
        ) from error


def own_line(error: BaseException, source_file: str) -> str:
    from probes.step.harness import own_line as harness_own_line

    return harness_own_line(error, source_file)


def static_problem(spec: str, base: Path) -> str | None:
    """What is visibly wrong with ``trainer.factory`` without running any of it (parse time):
    the spec's form, the file or module, that it parses and defines the function; else None."""
    from probes.step.harness import defined_names

    try:
        module_name, function_name = split_spec(spec)
    except FactoryError as error:
        return str(error)
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = base / module_name
        if not path.is_file():
            return (
                f"{FACTORY_KEY} '{spec}': file '{module_name}' does not exist (a relative path "
                f"starts at the working directory {base})."
            )
    else:
        found = find_module_spec(module_name)
        if found is None:
            return f"{FACTORY_KEY} '{spec}': no module '{module_name}' on this Python path."
        origin = getattr(found, "origin", None)
        if not (origin and origin.endswith(".py") and Path(origin).is_file()):
            return None
        path = Path(origin)
    try:
        names = defined_names(path.read_text(encoding="utf-8"))
    except SyntaxError as error:
        return f"{FACTORY_KEY} '{spec}': {path}:{error.lineno} does not parse ({error.msg})."
    if names is not None and function_name not in names:
        return (
            f"{FACTORY_KEY} '{spec}': {path} defines no '{function_name}'; define "
            "build_trainer(settings) -> Trainer there, or name the function it has."
        )
    return None


def load_factory(spec: str) -> Factory:
    """The factory named by ``trainer.factory``; every failure names the key and what to do."""
    module_name, function_name = split_spec(spec)
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _import_file(spec, Path(module_name))
    else:
        try:
            module = importlib.import_module(module_name)
        except SyntaxError as error:
            raise FactoryError(
                f"{FACTORY_KEY} '{spec}': {error.filename}:{error.lineno} does not parse "
                f"({error.msg}); fix the file."
            ) from error
        except ImportError as error:
            raise FactoryError(
                f"{FACTORY_KEY} '{spec}': cannot import '{module_name}' ({error}); give a .py "
                "path or an import path on PYTHONPATH."
            ) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise FactoryError(
            f"{FACTORY_KEY} '{spec}': '{module_name}' defines no function '{function_name}'; "
            "define build_trainer(settings) -> Trainer there, or name the function it has."
        )
    source = getattr(module, "__file__", "") or ""
    return Factory(spec=spec, function=function, source_file=source)


def build_trainer(factory: Factory, settings: Mapping[str, Any]) -> Any:
    """Call the factory with ``settings``; the result must be a Trainer with a train dataset."""
    import transformers

    try:
        trainer = factory.function(dict(settings))
    except Exception as error:
        raise FactoryError(
            f"{FACTORY_KEY} '{factory.spec}': the factory raised {type(error).__name__}: "
            f"{error}{own_line(error, factory.source_file)} (settings: {sorted(settings)}). "
            "Fix the factory (call it with these settings alone to reproduce)."
        ) from error
    if not isinstance(trainer, transformers.Trainer):
        raise FactoryError(
            f"{FACTORY_KEY} '{factory.spec}': the factory returned {type(trainer).__name__}, "
            "not a transformers.Trainer (or trl.SFTTrainer); return the trainer you train with."
        )
    return checked(trainer, FACTORY_KEY, factory.spec)


def checked(trainer: Any, key: str, spec: str) -> Any:
    """A built trainer the probes can run: a train dataset, and a tokenizer to read the
    vocabulary and pad id from (``tokenizer_of``)."""
    if trainer.train_dataset is None:
        raise FactoryError(
            f"{key} '{spec}': the trainer has no train_dataset; build it with "
            "the dataset you train on (the probes read its prepared rows)."
        )
    if tokenizer_of(trainer) is None:
        collator = trainer.data_collator
        raise FactoryError(
            f"{key} '{spec}': the {type(trainer).__name__} has no processing_class and its "
            f"collator {getattr(collator, '__name__', type(collator).__name__)} no tokenizer; pass "
            "processing_class=tokenizer to the trainer (the probes read its vocabulary)."
        )
    return trainer


def tokenizer_of(trainer: Any) -> Any:
    """The trainer's tokenizer: its ``processing_class``, else its collator's ``tokenizer``
    (a plain Trainer whose tokenizer lives only in its collator); None where neither has one."""
    found = getattr(trainer, "processing_class", None)
    return found if found is not None else getattr(trainer.data_collator, "tokenizer", None)
