"""The longest functions and modules of the package: what the style guide's limits are about.

    python tools/function_lengths.py                    # scripts/probes, > 80 and > 500 lines
    python tools/function_lengths.py PATH ... --functions 100 --modules 600 --check

A function's length is its ``def`` line to its last line (decorators not counted; docstring,
comments and blank lines inside counted), read from the AST, so nested functions and methods are
listed on their own under their qualified name (``Class.method``, ``outer.<locals>.inner``) and
are also part of the function around them. A module's length is its number of lines. Prints the
functions over ``--functions`` lines and the modules over ``--modules`` lines, longest first, then
a one-line count. Exits 0, or with ``--check`` 1 when anything is over a limit.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "scripts" / "probes"
FUNCTION_LIMIT = 80
MODULE_LIMIT = 500


@dataclass(frozen=True)
class Length:
    path: str
    line: int
    name: str  # qualified name; "" for a module
    lines: int


def python_files(paths: Iterable[Path]) -> list[Path]:
    files: set[Path] = set()
    for path in paths:
        if path.is_dir():
            files.update(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        elif path.suffix == ".py":
            files.add(path)
    return sorted(files)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def function_lengths(tree: ast.AST, path: str) -> Iterator[Length]:
    """Every function and method in ``tree`` with its length, nested ones included."""

    def visit(node: ast.AST, prefix: str) -> Iterator[Length]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield Length(path, child.lineno, name, child.end_lineno - child.lineno + 1)
                yield from visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def measure(paths: Iterable[Path]) -> tuple[list[Length], list[Length]]:
    """(functions, modules), each longest first."""
    functions: list[Length] = []
    modules: list[Length] = []
    for file in python_files(paths):
        source = file.read_text(encoding="utf-8")
        shown = _display(file)
        modules.append(Length(shown, 1, "", len(source.splitlines())))
        functions.extend(function_lengths(ast.parse(source, filename=str(file)), shown))
    order = lambda item: (-item.lines, item.path, item.line)  # noqa: E731
    return sorted(functions, key=order), sorted(modules, key=order)


def report(
    functions: list[Length], modules: list[Length], function_limit: int, module_limit: int
) -> tuple[list[str], int]:
    """The lines to print and how many items are over a limit."""
    long_functions = [f for f in functions if f.lines > function_limit]
    long_modules = [m for m in modules if m.lines > module_limit]
    lines = [f"functions over {function_limit} lines:"]
    lines += [f"{f.lines:6d}  {f.path}:{f.line}  {f.name}" for f in long_functions] or ["  none"]
    lines.append(f"modules over {module_limit} lines:")
    lines += [f"{m.lines:6d}  {m.path}" for m in long_modules] or ["  none"]
    longest = functions[0] if functions else None
    lines.append(
        f"{len(long_functions)} of {len(functions)} functions over {function_limit} lines, "
        f"{len(long_modules)} of {len(modules)} modules over {module_limit} lines"
        + (f"; longest function {longest.name} ({longest.lines})" if longest else "")
    )
    return lines, len(long_functions) + len(long_modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[DEFAULT_ROOT])
    parser.add_argument("--functions", type=int, default=FUNCTION_LIMIT, metavar="LINES")
    parser.add_argument("--modules", type=int, default=MODULE_LIMIT, metavar="LINES")
    parser.add_argument("--check", action="store_true", help="exit 1 when anything is over")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        parser.error(f"no such path: {', '.join(missing)}")
    functions, modules = measure(args.paths)
    lines, over = report(functions, modules, args.functions, args.modules)
    print("\n".join(lines))
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
