"""config/README.md from the config schema's descriptions, so the page cannot drift from the code.

    python tools/config_docs.py            # print the page
    python tools/config_docs.py --write    # write config/README.md
    python tools/config_docs.py --check    # exit 1 when config/README.md differs, or a key has
                                           # no description

Every key of workflow/schemas/config.schema.yaml gets one row: its dotted name, type, default and
the schema's `description`. tests/unit/test_docs.py fails when the page and the schema differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
PAGE = REPO / "config" / "README.md"

INTRO = """\
# Configuration

Every key the workflow reads, its type, default and meaning. Copy `config/config.yaml` (the
embedded default, with comments), edit it, and pass it with `--configfile my.yaml`; a stage
script takes one value with `--set section.key=YAML`. The config is validated against
[the schema](../workflow/schemas/config.schema.yaml) before any job runs: an unknown key, a wrong
type or a path that does not exist stops the run with a message naming it. Defaults live only in
the schema. `config/trainer.yaml` is the default with `trainer.factory` set (what `make run`
runs); `config/mask-gemma3-27b.yaml` is a large real architecture for the mask gate;
`config/profiles/slurm/` is the cluster profile.

<!-- Generated from workflow/schemas/config.schema.yaml by tools/config_docs.py. Do not edit:
     edit the schema's descriptions, then run `python tools/config_docs.py --write`. -->
"""


def load_schema(path: Path = SCHEMA) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def leaves(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(dotted key, its schema) for every key below `schema`, objects before their keys;
    an array of objects (data.files) names its items' keys `files[].path`."""
    for name, sub in (schema.get("properties") or {}).items():
        key = f"{prefix}{name}"
        yield key, sub
        if "properties" in sub:
            yield from leaves(sub, f"{key}.")
        items = sub.get("items")
        if isinstance(items, Mapping) and "properties" in items:
            yield from leaves(items, f"{key}[].")


def keys(schema: Mapping[str, Any] | None = None) -> set[str]:
    """Every dotted config key of the schema (`data.files[].path` also as `data.files.path`)."""
    schema = load_schema() if schema is None else schema
    names = {key for key, _ in leaves(schema)}
    return names | {name.replace("[]", "") for name in names}


def missing_descriptions(schema: Mapping[str, Any]) -> list[str]:
    return [key for key, sub in leaves(schema) if not str(sub.get("description", "")).strip()]


def _type(sub: Mapping[str, Any]) -> str:
    if "enum" in sub:
        return " \\| ".join(f"`{value}`" for value in sub["enum"])
    kind = sub.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    text = " or ".join(str(k) for k in kinds)
    items = sub.get("items")
    if "array" in kinds and isinstance(items, Mapping):
        enum = items.get("enum")
        inner = " \\| ".join(f"`{v}`" for v in enum) if enum else items.get("type")
        text = text.replace("array", f"array of {inner}", 1)
    return text


def _default(sub: Mapping[str, Any], required: bool) -> str:
    if "default" not in sub:
        return "required" if required else "—"
    value = sub["default"]
    if isinstance(value, dict) and not value and "properties" in sub:
        return "—"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _section(name: str, sub: Mapping[str, Any], required: bool) -> list[str]:
    lines = [f"## `{name}`", ""]
    if sub.get("description"):
        lines += [_cell(sub["description"]), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, leaf in leaves(sub, f"{name}."):
        parent = sub
        for part in key.split(".")[1:-1]:
            parent = parent["properties"].get(part.removesuffix("[]"), {})
            parent = parent.get("items", parent) if part.endswith("[]") else parent
        is_required = key.split(".")[-1] in (parent.get("required") or [])
        kind = "section" if "properties" in leaf else _type(leaf)
        default = "—" if "properties" in leaf else _default(leaf, is_required)
        meaning = _cell(leaf.get("description", ""))
        lines.append(f"| `{key}` | {kind} | {default} | {meaning} |")
    return [*lines, ""]


def render(schema: Mapping[str, Any] | None = None) -> str:
    schema = load_schema() if schema is None else schema
    lines = [INTRO]
    for name, sub in schema["properties"].items():
        lines += _section(name, sub, name in (schema.get("required") or []))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(REPO)}")
    group.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args(argv)
    schema = load_schema()
    page = render(schema)
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        problems = [f"no description: {key}" for key in missing_descriptions(schema)]
        if not PAGE.is_file() or PAGE.read_text() != page:
            stale = f"{PAGE.relative_to(REPO)} is stale: run python tools/config_docs.py --write"
            problems.append(stale)
        print("\n".join(problems) or "config/README.md matches the schema")
        return 1 if problems else 0
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
