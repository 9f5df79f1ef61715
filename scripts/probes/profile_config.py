"""Config for the profile stage when it runs without Snakemake: the same schema defaults.

Snakemake fills defaults from workflow/schemas/config.schema.yaml when it validates the config;
the standalone entry point (e.g. on a bare GPU machine without Snakemake) fills them from the
same file, so both paths run with one set of defaults.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
CONFIG = Path(__file__).resolve().parents[2] / "config" / "config.yaml"


def fill_defaults(instance: Any, schema: dict[str, Any]) -> Any:
    """Deep copy of `instance` with every missing property that has a schema default filled in
    (recursively, also inside defaults that are themselves objects)."""
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return copy.deepcopy(instance)
    out = copy.deepcopy(instance)
    for key, subschema in (schema.get("properties") or {}).items():
        if key not in out and "default" in subschema:
            out[key] = copy.deepcopy(subschema["default"])
        if key in out:
            out[key] = fill_defaults(out[key], subschema)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    with open(path) as handle:
        return yaml.safe_load(handle) or {}


def stage_config(
    configfile: str | Path | None = None, schema_path: str | Path = SCHEMA
) -> dict[str, Any]:
    """`training` and `profile` sections of a config file (default config/config.yaml if it
    exists), with the schema's defaults filled in."""
    schema = load_yaml(schema_path)
    raw: dict[str, Any] = {}
    if configfile is not None:
        raw = load_yaml(configfile)
    elif CONFIG.is_file():
        raw = load_yaml(CONFIG)
    sections = schema["properties"]
    return {
        key: fill_defaults(raw.get(key) or {}, sections[key]) for key in ("training", "profile")
    } | {"model": raw.get("model") or {}}
