"""Loading the user's training harness: a file path or an import path, never a copy of it.

The profile calls the harness's own `discover_target_modules` and `compute_loss` for every timed
step. Optional hooks (apply_adapters, build_optimizer, loss_from_hidden, configure) are used when
present; see probes/step/reference_harness.py for the contract.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from probes.errors import ProbeError

REQUIRED = ("discover_target_modules", "compute_loss")
OPTIONAL = ("apply_adapters", "build_optimizer", "loss_from_hidden", "configure")
DEFAULT_HARNESS = "probes.reference_harness"


class HarnessError(ProbeError, ValueError):
    """The harness cannot be imported or lacks a required function; the message says what to do."""


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


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise HarnessError(
            f"profile.harness: file '{path}' does not exist; give a .py file or an import path "
            "(e.g. my_package.train) that defines discover_target_modules and compute_loss."
        )
    # a unique module name per file, so two harnesses with the same file name never collide
    name = "probes_user_harness_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HarnessError(f"profile.harness: cannot import '{path}' as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # the harness may import siblings from its own directory
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(name, None)
        raise HarnessError(
            f"profile.harness: importing '{path}' failed ({type(error).__name__}: {error})."
        ) from error
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


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
    hooks = {
        name: getattr(module, name) for name in OPTIONAL if callable(getattr(module, name, None))
    }
    source = inspect.getsourcefile(module) or getattr(module, "__file__", "") or ""
    return Harness(
        spec=spec,
        module=module,
        source_file=source,
        discover_target_modules=module.discover_target_modules,
        compute_loss=module.compute_loss,
        hooks=hooks,
    )
