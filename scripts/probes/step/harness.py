"""Loading the user's training harness: a file path or an import path, never a copy of it.

The profile calls the harness's own `discover_target_modules` and `compute_loss` for every timed
step. Optional hooks (apply_adapters, build_optimizer, loss_from_hidden, configure) are used when
present; see probes/step/reference_harness.py for the contract.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from probes.errors import ProbeError

REQUIRED = ("discover_target_modules", "compute_loss")
OPTIONAL = ("apply_adapters", "build_optimizer", "loss_from_hidden", "configure")
DEFAULT_HARNESS = "probes.reference_harness"


class HarnessError(ProbeError, ValueError):
    """The harness cannot be imported or lacks a required function; the message says what to do."""


class HarnessCallError(HarnessError):
    """A call into the harness raised, or compute_loss returned a loss backward cannot use."""


def defined_names(source: str) -> set[str] | None:
    """Top-level names a module's source defines (def, class, assignment, import; inside
    top-level if/try/with blocks too), without running it; None where they cannot be known
    statically (``import *``, a module ``__getattr__``)."""
    names: set[str] = set()
    for node in _top_level(ast.parse(source).body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
    return None if "__getattr__" in names else names


def _top_level(body: list[ast.stmt]):
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def missing_required(source: str) -> list[str]:
    """Required functions the source visibly lacks ([] where it cannot be told statically)."""
    names = defined_names(source)
    return [] if names is None else [name for name in REQUIRED if name not in names]


def describe_batch(args: tuple, kwargs: dict) -> str:
    """Shapes of the tensors among a call's arguments (a batch dict's keys with theirs)."""
    parts = []
    for value in [*args, *kwargs.values()]:
        if isinstance(value, dict):
            parts += [f"{k} {_shape(v)}" for k, v in value.items() if _shape(v)]
        elif _shape(value):
            parts.append(_shape(value))
    return ", ".join(parts)


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return "x".join(str(int(d)) for d in shape) if shape is not None else ""


def own_line(error: BaseException, source_file: str) -> str:
    """Where the harness's own code raised: its deepest frame in the harness file (else the
    deepest frame), as ``file:line (code)``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    mine = [f for f in frames if source_file and Path(f.filename) == Path(source_file)]
    frame = (mine or frames)[-1]
    code = f" ({frame.line.strip()})" if frame.line else ""
    return f" at {Path(frame.filename).name}:{frame.lineno}{code}"


def guarded(spec: str, name: str, fn: Callable[..., Any], source_file: str) -> Callable[..., Any]:
    """`fn` (a harness function) with every failure named: profile.harness, the function, the
    batch shape, the harness's own exception line. Out-of-memory errors pass unchanged (the
    profile records them per length); compute_loss must return a loss that requires grad."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        from probes.step.timing import is_out_of_memory

        try:
            result = fn(*args, **kwargs)
        except Exception as error:
            if is_out_of_memory(error) or isinstance(error, HarnessError):
                raise
            shapes = describe_batch(args, kwargs)
            raise HarnessCallError(
                f"profile.harness '{spec}': {name}() raised {type(error).__name__}: {error}"
                f"{own_line(error, source_file)}"
                + (f"; batch shape {shapes}" if shapes else "")
                + ". Fix the harness (call it on this shape alone to reproduce)."
            ) from error
        if name == "compute_loss":
            check_loss(spec, result, describe_batch(args, kwargs))
        return result

    return call


def check_loss(spec: str, loss: Any, shapes: str) -> None:
    """compute_loss must return a tensor backward() can start from (where grad is enabled)."""
    import torch

    if isinstance(loss, torch.Tensor):
        if torch.is_grad_enabled() and not loss.requires_grad:
            problem = "returned a tensor that does not require grad (detached, or computed "
            problem += "under torch.no_grad / from frozen parameters only)"
        elif loss.numel() != 1:
            problem = f"returned a tensor of shape {_shape(loss)}, not a scalar loss"
        else:
            return
    elif callable(getattr(loss, "backward", None)):
        return
    else:
        problem = f"returned {type(loss).__name__}, not a loss tensor"
    raise HarnessCallError(
        f"profile.harness '{spec}': compute_loss() {problem}; batch shape {shapes}. The profile "
        "calls loss.backward() on it, as training does: return the loss tensor itself."
    )


@dataclass
class Harness:
    spec: str
    module: ModuleType
    source_file: str
    discover_target_modules: Callable[[Any], list[str]]
    compute_loss: Callable[[Any, dict], Any]
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def hook(self, name: str) -> Callable[..., Any] | None:
        return self.hooks.get(name)

    def describe(self) -> dict[str, Any]:
        """What the provenance records: where the harness came from and which functions ran."""
        functions = {name: qualified_name(getattr(self, name)) for name in REQUIRED}
        functions.update({name: qualified_name(fn) for name, fn in self.hooks.items()})
        source = Path(self.source_file)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16] if source.is_file() else None
        return {
            "spec": self.spec,
            "module": self.module.__name__,
            "file": str(self.source_file),
            "file_sha256_16": digest,
            "functions": functions,
            "fallbacks": {
                name: "probes.reference_harness"
                for name in ("apply_adapters", "build_optimizer")
                if name not in self.hooks
            },
        }


def qualified_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def find_module_spec(dotted: str) -> ModuleSpec | None:
    """Where the module `dotted` would be imported from, or None where it cannot be found.

    Nothing is imported: the top-level name goes through importlib.util.find_spec, each further
    part through the path finder over its parent's search locations (an already imported parent's
    `__path__`), so checking a user's package never runs its code at parse time.
    """
    parts = dotted.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):  # ValueError: a loaded module without __spec__
        return None
    for depth in range(1, len(parts)):
        if spec is None:
            return None
        parent = sys.modules.get(".".join(parts[:depth]))
        search = getattr(parent, "__path__", None) if parent else spec.submodule_search_locations
        if search is None:  # the parent is a plain module, not a package
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: depth + 1]), list(search))
    return spec


class UnimportableFileError(ImportError):
    """The file cannot be loaded as a Python module at all (no loader for it)."""


def import_user_file(path: Path, prefix: str) -> ModuleType:
    """Import the user's .py file itself (never a copy) under a unique module name, `prefix` and
    a hash of its path, so two files with the same name never collide; its directory is on
    sys.path while it runs (it may import its siblings). An exception the file raises propagates
    with the module unregistered; UnimportableFileError when it cannot be a module."""
    name = prefix + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UnimportableFileError(f"cannot import '{path}' as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(directory)
    return module


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise HarnessError(
            f"profile.harness: file '{path}' does not exist; give a .py file or an import path "
            "(e.g. my_package.train) that defines discover_target_modules and compute_loss."
        )
    try:
        return import_user_file(path, "probes_user_harness_")
    except UnimportableFileError:
        raise HarnessError(f"profile.harness: cannot import '{path}' as a Python module.") from None
    except Exception as error:
        raise HarnessError(
            f"profile.harness: importing '{path}' failed ({type(error).__name__}: {error})."
        ) from error


def load_harness(spec: str | None) -> Harness:
    """Import the harness named by `spec` (a .py path or a dotted import path)."""
    spec = spec or DEFAULT_HARNESS
    if is_file_spec(spec):
        module = _import_file(Path(spec))
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as error:
            raise HarnessError(
                f"profile.harness: cannot import '{spec}' ({error}); give a .py file path or an "
                "import path on PYTHONPATH."
            ) from error
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise HarnessError(
            f"profile.harness '{spec}': missing function(s) {missing}; the profile calls the "
            "harness's own discover_target_modules(model) -> list[str] and "
            "compute_loss(model, batch) -> loss tensor."
        )
    source = inspect.getsourcefile(module) or getattr(module, "__file__", "") or ""
    hooks = {
        name: guarded(spec, name, getattr(module, name), source)
        for name in OPTIONAL
        if callable(getattr(module, name, None))
    }
    return Harness(
        spec=spec,
        module=module,
        source_file=source,
        discover_target_modules=guarded(
            spec, "discover_target_modules", module.discover_target_modules, source
        ),
        compute_loss=guarded(spec, "compute_loss", module.compute_loss, source),
        hooks=hooks,
    )
