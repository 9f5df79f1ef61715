"""What the workflow changes while the user's command runs in this process (probes.step.command).

Inside ``intercepting(settings)``:

- every ``TrainingArguments`` (``SFTConfig``, any subclass) the command constructs gets the
  workflow's settings written in before its own ``__post_init__`` runs (what ``apply_settings``
  does for a factory; the quiet settings among them: no report_to, no checkpoint, no hub push);
- every ``from_pretrained`` of a model (``AutoModelForCausalLM``, a model class, TRL's
  ``model_init_kwargs`` path, which ends there) gets the model settings (``MODEL_KEYS``);
- every ``transformers.Trainer`` it constructs is recorded, and its ``train()`` raises
  ``TrainerTaken`` carrying the trainer: the command's code after ``train()`` (saving, pushing,
  ending trackers) never runs;
- a launcher that would start the training script in a new process (``accelerate launch``, the
  ``trl`` CLI's ``launch_training_script``) runs it here instead, as one process;
- the environment is offline and tracker-free (``QUIET_ENV``);
- ``datasets`` fingerprints a tokenizer by a digest of its content (``fingerprint_tokenizer``)
  instead of pickling it whole: the same map, the same rows, seconds less per build.

Everything is put back on leaving the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import runpy
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from probes.step.factory import MODEL_KEYS

# the command runs offline, with no tracker: a hub download, a W&B run or telemetry fails or is
# off instead of reaching a network the probes do not use
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "WANDB_DISABLED": "true",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
}
APPLIED = "_probes_settings_applied"


class TrainerTaken(BaseException):  # noqa: N818 - a stop signal, not an error
    """Raised from the command's ``trainer.train()``: unwinds the command (a BaseException, so
    its own ``except Exception`` cannot swallow it) and carries the trainer it built."""

    def __init__(self, trainer: Any) -> None:
        super().__init__("trainer taken at train()")
        self.trainer = trainer


@dataclasses.dataclass
class Capture:
    """What the command did while intercepted."""

    trainers: list[Any] = dataclasses.field(default_factory=list)
    arguments: list[Any] = dataclasses.field(default_factory=list)
    model_loads: int = 0
    train_calls: int = 0
    taken: Any = None


def settings_for(args: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that are fields of ``args`` (model keys are for from_pretrained)."""
    fields = {f.name for f in dataclasses.fields(args)}
    return {k: v for k, v in settings.items() if k in fields and k not in MODEL_KEYS}


def arguments_classes(base: type) -> list[type]:
    """``base`` and every subclass defined so far (SFTConfig, the user's own)."""
    found, stack = [], [base]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


def patch_arguments(stack: contextlib.ExitStack, settings: Mapping[str, Any], capture: Capture):
    """Each TrainingArguments class's ``__post_init__`` writes the settings in first (once per
    object, at the outermost call: the class the command constructed), then runs its own."""
    from transformers import TrainingArguments

    def wrap(original):
        @functools.wraps(original)
        def post_init(self, *args, **kwargs):
            if not getattr(self, APPLIED, False):
                object.__setattr__(self, APPLIED, True)
                for key, value in settings_for(self, settings).items():
                    object.__setattr__(self, key, value)
                capture.arguments.append(self)
            return original(self, *args, **kwargs)

        return post_init

    for cls in arguments_classes(TrainingArguments):
        if "__post_init__" in vars(cls):
            stack.enter_context(patched(cls, "__post_init__", wrap(vars(cls)["__post_init__"])))


def patch_models(stack: contextlib.ExitStack, settings: Mapping[str, Any], capture: Capture):
    """``PreTrainedModel.from_pretrained`` with the model settings over the command's own."""
    from transformers import PreTrainedModel

    overrides = {k: settings[k] for k in MODEL_KEYS if k in settings}
    original = vars(PreTrainedModel)["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        capture.model_loads += 1
        if "dtype" in overrides:
            kwargs.pop("torch_dtype", None)  # the old name of the same argument
        return original(cls, *args, **{**kwargs, **overrides})

    stack.enter_context(patched(PreTrainedModel, "from_pretrained", classmethod(from_pretrained)))


def patch_trainer(stack: contextlib.ExitStack, capture: Capture) -> None:
    """Every Trainer the command builds is recorded; its ``train()`` raises TrainerTaken."""
    from transformers import Trainer

    original = Trainer.__init__

    def take(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        capture.train_calls += 1
        if capture.taken is None:
            capture.taken = trainer
        raise TrainerTaken(trainer)

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if all(t is not self for t in capture.trainers):
            capture.trainers.append(self)
            self.train = functools.partial(take, self)

    stack.enter_context(patched(Trainer, "__init__", init))


def run_launched_here(args: Any) -> None:
    """What ``accelerate launch`` would start in a new process, run here as one process: its
    training script (or ``-m`` module) with its arguments."""
    script = str(args.training_script)
    rest = [str(a) for a in (args.training_script_args or [])]
    if getattr(args, "module", False):
        run_entry_module(script, rest)
    else:
        run_entry_file(script, rest)


def patch_launchers(stack: contextlib.ExitStack) -> None:
    """``accelerate launch`` and the ``trl`` CLI run their training script in this process."""
    with contextlib.suppress(ImportError):
        import accelerate.commands.launch as launch

        stack.enter_context(patched(launch, "launch_command", run_launched_here))
    with contextlib.suppress(ImportError):
        import trl.cli.accelerate_launcher as trl_launcher

        original = trl_launcher.launch_training_script
        here = functools.partial(original, launch_command_fn=run_launched_here)
        stack.enter_context(patched(trl_launcher, "launch_training_script", here))


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def process_state(argv: list[str], path_entry: str | None) -> Iterator[None]:
    """``sys.argv`` as the command's own, its script's folder first on ``sys.path`` (as
    ``python script.py`` puts it); both put back after."""
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    if path_entry is not None:
        sys.path.insert(0, path_entry)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = old_argv, old_path


def run_entry_file(path: str, args: list[str]) -> None:
    """A script run as ``python path args...`` runs it."""
    folder = os.path.dirname(os.path.abspath(path))
    with process_state([path, *args], folder):
        runpy.run_path(path, run_name="__main__")  # its globals are not returned: never shown


def run_entry_module(module: str, args: list[str]) -> None:
    with process_state([module, *args], os.getcwd()):
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # nor a module's


def patch_offline(stack: contextlib.ExitStack) -> None:
    """The hub libraries read HF_HUB_OFFLINE when imported: their flags too, where loaded."""
    for module, name in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
    ):
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            stack.enter_context(patched(loaded, name, True))


def backend_digest(backend: Any) -> str:
    """sha256 of a fast tokenizer's backend as its JSON (vocabulary, merges, added tokens,
    normalizer, pre-tokenizer, post-processor), its runtime truncation and padding left out (as
    datasets' own reducer leaves them out)."""
    import hashlib

    truncation, padding = backend.truncation, backend.padding
    backend.no_truncation()
    backend.no_padding()
    try:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    finally:
        if truncation is not None:
            backend.enable_truncation(**truncation)
        if padding is not None:
            backend.enable_padding(**padding)


BACKEND_COPIES = ("_tokenizer", "_vocab", "_merges")  # the backend and the copies it was built from
SCRATCH = ("cache", "deprecation_warnings")  # what datasets' own reducer empties


def fingerprint_tokenizer(original: Any) -> Any:
    """A datasets pickler reducer for tokenizers: the Python state as datasets pickles it, the
    backend (and the vocabulary and merges it was built from) as one digest. A map whose function
    takes the tokenizer (TRL's tokenization) is fingerprinted in about a second, not 5-6 (the
    default's 262k-token vocabulary and 515k merges pickled item by item); a changed vocabulary,
    template or setting still changes the fingerprint."""

    def save(pickler: Any, obj: Any) -> None:
        backend = vars(obj).get("_tokenizer")
        if backend is None or not hasattr(backend, "to_str"):
            return original(pickler, obj)
        state = {k: v for k, v in vars(obj).items() if k not in BACKEND_COPIES + SCRATCH}
        state["probes_backend_sha256"] = backend_digest(backend)
        pickler.save_reduce(type(obj), (), state=state, obj=obj)
        return None

    return save


def patch_fingerprints(stack: contextlib.ExitStack) -> None:
    try:
        from datasets.utils import _dill
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return
    name = "_save_transformersPreTrainedTokenizerBase"
    original = getattr(_dill, name, None)
    if original is None:
        return
    reducer = fingerprint_tokenizer(original)
    stack.enter_context(patched(_dill, name, reducer))
    for cls in [c for c in _dill.Pickler.dispatch if isinstance(c, type)]:
        if issubclass(cls, PreTrainedTokenizerBase):  # registered by an earlier map here
            stack.enter_context(item_patched(_dill.Pickler.dispatch, cls, reducer))


@contextlib.contextmanager
def item_patched(mapping: dict, key: Any, value: Any) -> Iterator[None]:
    old = mapping[key]
    mapping[key] = value
    try:
        yield
    finally:
        mapping[key] = old


@contextlib.contextmanager
def intercepting(settings: Mapping[str, Any]) -> Iterator[Capture]:
    """The block in which the command runs (see the module's docstring)."""
    capture = Capture()
    with contextlib.ExitStack() as stack:
        stack.enter_context(environment(QUIET_ENV))
        patch_offline(stack)
        patch_fingerprints(stack)
        patch_arguments(stack, settings, capture)
        patch_models(stack, settings, capture)
        patch_trainer(stack, capture)
        patch_launchers(stack)
        yield capture
