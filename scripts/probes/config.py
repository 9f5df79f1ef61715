"""Config checks that JSON schema cannot express, and path helpers shared by the rules."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from probes.contracts import (
    DATA_FILES,
    MODEL_CONFIG,
    MODEL_TOKENIZER,
    RESULTS_DIR,
    STAGE_INPUTS,
    TOKENIZER_FILES,
    stage_outputs,
)
from probes.errors import ProbeError
from probes.step.harness import find_module_spec, missing_required
from probes.step.harness import is_file_spec as is_harness_file

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"

# Paths that rules of the workflow materialise; they need not exist at parse time.
DEFAULT_MODEL_DIR = "resources/model/gemma-3-270m"
DEFAULT_DATA_FILE = "resources/data/chitchat.parquet"


class ConfigError(ProbeError, ValueError):
    """A config value that cannot work; the message names the key and what to do."""


def model_file(config: dict[str, Any], name: str) -> str:
    """Path of a file in the model directory (`config.json` may come from model.config_path)."""
    if name == "config.json" and config["model"].get("config_path"):
        return str(config["model"]["config_path"])
    return str(Path(config["model"]["path"]) / name)


def stage_inputs(
    stage: str, config: dict[str, Any], results_dir: str | Path = RESULTS_DIR
) -> dict[str, str | list[str]]:
    """Input key -> path(s) of a stage, from its declaration (probes.contracts.STAGE_INPUTS)."""
    user_files = {
        MODEL_CONFIG: lambda: model_file(config, "config.json"),
        MODEL_TOKENIZER: lambda: [model_file(config, name) for name in TOKENIZER_FILES],
        DATA_FILES: lambda: [str(entry["path"]) for entry in config["data"]["files"]],
    }
    inputs = {
        key: stage_outputs(source[0], results_dir)[source[1]]
        if isinstance(source, tuple)
        else user_files[source]()
        for key, source in STAGE_INPUTS[stage].items()
    }
    factory = factory_file(config)
    if factory and stage in TRAINER_STAGES:
        inputs["factory"] = factory  # an edit to the user's factory or script reruns what it built
    command_inputs = (config.get("trainer") or {}).get("command_inputs") or []
    if command_inputs and stage in TRAINER_STAGES:
        inputs["command_inputs"] = [str(path) for path in command_inputs]
    return inputs


# the stages that build the user's trainer (trainer.factory) when one is given
TRAINER_STAGES = ("padding", "profile", "replay", "realize", "data_parallel")


def factory_file(config: Mapping[str, Any]) -> str | None:
    """The .py file ``trainer.factory`` or ``trainer.command`` names (None for an import path,
    an installed command or no trainer)."""
    from probes.step.source import source_file

    return source_file(config.get("trainer") or {})


def check_removed_options(config: Mapping[str, Any]) -> None:
    """A value the workflow no longer offers, named with what replaces it (before the schema's
    terser "is not one of" message)."""
    from probes.batching.packing import PackingStrategyError, check_strategy

    bucket = config.get("bucket")
    strategies = bucket.get("packing") if isinstance(bucket, Mapping) else None
    for index, strategy in enumerate(strategies if isinstance(strategies, list | tuple) else ()):
        try:
            check_strategy(strategy)
        except PackingStrategyError as error:
            raise ConfigError(f"config key bucket.packing.{index}: {error}") from None


def check_config_paths(config: dict[str, Any], workdir: Path | None = None) -> None:
    """Fail before any job runs if a user-given path does not exist."""
    base = workdir or Path.cwd()
    model_path = config["model"]["path"]
    if model_path != DEFAULT_MODEL_DIR and not (base / model_path).is_dir():
        raise ConfigError(
            f"config key model.path: directory '{model_path}' does not exist; "
            "point it at a local Hugging Face model directory (config.json, tokenizer files, "
            f"safetensors) or use the embedded default '{DEFAULT_MODEL_DIR}'."
        )
    for key in ("config_path", "chat_template"):
        value = config["model"].get(key)
        if value and not (base / value).is_file():
            raise ConfigError(f"config key model.{key}: file '{value}' does not exist.")
    for index, entry in enumerate(config["data"]["files"]):
        path = entry["path"]
        if path != DEFAULT_DATA_FILE and not (base / path).is_file():
            raise ConfigError(
                f"config key data.files[{index}].path: file '{path}' does not exist; "
                "give a .jsonl or .parquet file of messages, conversations or text."
            )
        if not path.endswith((".jsonl", ".parquet")):
            raise ConfigError(
                f"config key data.files[{index}].path: '{path}' is neither .jsonl nor .parquet."
            )
    harness = config.get("profile", {}).get("harness")
    if harness:
        check_harness(harness, base)
    from probes.step.source import static_problem

    problem = static_problem(config.get("trainer") or {}, base)
    if problem:
        raise ConfigError(f"config key {problem}")


def check_harness(harness: str, base: Path) -> None:
    """profile.harness names a .py file that exists or an import path that can be found, checked
    without running the harness (the profile job imports it)."""
    what = (
        "give your training module as a .py file path or an import path (e.g. my_package.train) "
        "that defines discover_target_modules(model) and compute_loss(model, batch)"
    )
    if is_harness_file(harness):
        if not harness.endswith(".py"):
            raise ConfigError(f"config key profile.harness: '{harness}' is not a .py file; {what}.")
        if not (base / harness).is_file():
            raise ConfigError(
                f"config key profile.harness: file '{harness}' does not exist (a relative path "
                f"starts at the working directory {base}); {what}."
            )
        check_harness_source(harness, base / harness, what)
        return
    module = find_module_spec(harness)
    if module is None:
        raise ConfigError(
            f"config key profile.harness: no module '{harness}' on this Python path (the "
            "workflow's scripts/, PYTHONPATH, installed packages); install the package or add "
            f"its directory to PYTHONPATH, or {what}. A module installed only in the job's own "
            "environment (e.g. --software-deployment-method conda) is not visible here: give its "
            ".py path instead."
        )
    origin = getattr(module, "origin", None)
    if origin and origin.endswith(".py") and Path(origin).is_file():
        check_harness_source(harness, Path(origin), what)


def check_harness_source(harness: str, path: Path, what: str) -> None:
    """The harness's source parses and visibly defines the required functions (read, not run)."""
    try:
        missing = missing_required(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError) as error:
        where = f" line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise ConfigError(
            f"config key profile.harness: '{harness}' ({path}) does not parse{where}: "
            f"{type(error).__name__}: {getattr(error, 'msg', error)}."
        ) from error
    if missing:
        raise ConfigError(
            f"config key profile.harness: '{harness}' ({path}) defines no {missing}; {what}."
        )


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    with open(path) as handle:
        return yaml.safe_load(handle) or {}


def fill_defaults(instance: Any, schema: dict[str, Any]) -> Any:
    """Deep copy of `instance` with every missing property that has a schema default filled in
    (recursively: inside defaults that are objects, and in each item of an array of objects)."""
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        return [fill_defaults(item, schema["items"]) for item in instance]
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return copy.deepcopy(instance)
    out = copy.deepcopy(instance)
    for key, subschema in (schema.get("properties") or {}).items():
        if key not in out and "default" in subschema:
            out[key] = copy.deepcopy(subschema["default"])
        if key in out:
            out[key] = fill_defaults(out[key], subschema)
    return out


@functools.cache
def schema() -> dict[str, Any]:
    """The workflow's JSON schema: the one place config defaults are written."""
    return load_yaml(SCHEMA)


def schema_default(section: str, key: str) -> Any:
    """One default as the schema writes it (for dataclasses used outside a validated config)."""
    return schema()["properties"][section]["properties"][key]["default"]


def apply_overrides(config: dict[str, Any], assignments: Mapping[str, str]) -> dict[str, Any]:
    """`{"training.max_seq_len": "2048"}` -> config with that value (parsed as YAML) set."""
    import yaml

    for dotted, text in assignments.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(text)
    return config


def merge_config(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`update` merged over `base` as Snakemake merges config files: dicts recursively."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def blame(path: Path, key: str, overrides: Mapping[str, str]) -> str:
    """Where a bad value came from: the `--set` that wrote it (or wrote under the key that is
    wrong), else the config file."""
    top = key == "(top level)"
    for dotted, text in overrides.items():
        if top or dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
            if not top or dotted.split(".")[0] not in schema().get("properties", {}):
                return f"--set {dotted}={text}"
    return str(path)


def load_config(
    configfile: str | Path | None = None, overrides: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The workflow config for a standalone (non-Snakemake) run: validated against the
    workflow's schema and default-filled from it, so both paths run with one set of defaults.

    As `snakemake --configfile F` does, F is merged over the Snakefile's config/config.yaml
    (mappings key by key, other values replaced), so an example such as
    config/mask-gemma3-27b.yaml needs to say only what differs.
    Validation needs jsonschema; on a bare GPU machine without it only the defaults are filled.
    """
    path = Path(configfile or DEFAULT_CONFIG)
    raw = load_yaml(DEFAULT_CONFIG)
    if path.resolve() != DEFAULT_CONFIG.resolve():
        raw = merge_config(raw, load_yaml(path))
    raw = apply_overrides(raw, overrides or {})
    try:
        check_removed_options(raw)
    except ConfigError as error:
        raise ConfigError(f"{blame(path, 'bucket.packing', overrides or {})}: {error}") from None
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema()).iter_errors(raw)
        )
        if error is not None:
            key = ".".join(str(part) for part in error.absolute_path) or "(top level)"
            raise ConfigError(
                f"{blame(path, key, overrides or {})}: config key {key}: {error.message}"
            )
    return fill_defaults(raw, schema())
