"""Import circles among a package's modules, read from the AST (nothing is imported).

    python tools/import_cycles.py                 # scripts/probes: module-level and lazy imports
    python tools/import_cycles.py ROOT --check    # exit 1 when any module-level or lazy circle

Two graphs: the imports at module level (a circle there can fail at import time) and every
import, those inside functions too (a lazy import only hides a circle; the modules still depend
on each other). ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else
to ``pkg``. Prints each circle (a strongly connected set of modules) under its graph, then a
one-line count. Exits 0, or with ``--check`` 1 when either graph has a circle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "scripts" / "probes"


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at `root` by its dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> Iterator[str]:
    """The package's modules one import statement names (`module` is where it stands)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: up from the importing module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            target = target if target in modules else base
            if target in modules:
                yield target


def import_graph(modules: dict[str, Path], lazy: bool) -> dict[str, set[str]]:
    """module -> the modules it imports: at module level only, or anywhere (`lazy`)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = ast.walk(tree) if lazy else tree.body
        for node in nodes:
            for target in imported(node, name, path.name == "__init__.py", modules):
                if target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--check", action="store_true", help="exit 1 when there is a circle")
    args = parser.parse_args(argv)
    if not (args.root / "__init__.py").is_file():
        parser.error(f"{args.root} is not a package (no __init__.py)")
    modules = module_files(args.root)
    counts = {}
    for label, lazy in (("module-level imports", False), ("all imports, lazy ones too", True)):
        found = circles(import_graph(modules, lazy))
        counts[label] = len(found)
        print(f"circles in {label}:")
        print("\n".join(f"  {' <-> '.join(c)}" for c in found) or "  none")
    print(
        ", ".join(f"{n} in {label}" for label, n in counts.items()) + f" ({len(modules)} modules)"
    )
    return 1 if args.check and any(counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
