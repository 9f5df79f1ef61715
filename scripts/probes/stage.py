"""One entry shape for every stage, and one all-or-nothing writer.

Each stage is `run(inputs, outputs, cfg) -> None` in the package. Its script under `scripts/` only
adapts `snakemake.*` or argparse to that call through `main()` below, so every stage logs, fails and
exits the same way: a `ProbeError` (bad input, failed control) is logged as one clear message and
exits 1; outputs are written by `OutputSet` all together or not at all.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from probes import io
from probes.contracts import RESULTS_DIR, report_inputs, stage_outputs
from probes.errors import ControlFailedError, ProbeError
from probes.logs import setup_logging
from probes.settings import WorkflowConfig
from probes.step.threads import RULE_THREADS_ENV

StageRun = Callable[[Mapping[str, Any], Mapping[str, str], WorkflowConfig], None]


# ---------------------------------------------------------------------------------------------
# All-or-nothing outputs
# ---------------------------------------------------------------------------------------------


class OutputSet:
    """Stages every output beside its target; `commit` renames all of them into place at once.

    Nothing reaches a target path before every output has been written, so a stage that fails
    half-way leaves the previous run's files (or none) behind, never a mix.
    """

    def __init__(self, paths: Mapping[str, str | Path]) -> None:
        self.paths = {key: Path(path) for key, path in paths.items()}
        self._staged: dict[str, Path] = {}

    def staging_path(self, key: str, directory: bool = False) -> Path:
        """A fresh temporary path beside the target of `key` (a directory if asked)."""
        if key in self._staged:
            raise ValueError(f"output {key!r} written twice")
        target = self.paths[key]
        target.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{target.name}."
        if directory:
            staged = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
            staged.chmod(0o777 & ~_umask())
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
            os.close(fd)
            staged = Path(name)
            staged.chmod(0o666 & ~_umask())
        self._staged[key] = staged
        return staged

    def parquet(self, key: str, frame: pd.DataFrame, provenance: Mapping[str, Any]) -> None:
        io.write_parquet(frame, self.staging_path(key), dict(provenance))

    def json(self, key: str, obj: Any) -> None:
        io.write_json(obj, self.staging_path(key))

    def text(self, key: str, text: str) -> None:
        io.write_text(text, self.staging_path(key))

    def directory(self, key: str) -> Path:
        return self.staging_path(key, directory=True)

    def commit(self) -> None:
        unwritten = sorted(set(self.paths) - set(self._staged))
        if unwritten:
            raise RuntimeError(f"stage finished without writing output(s) {unwritten}")
        for key, staged in self._staged.items():
            target = self.paths[key]
            if staged.is_dir() and target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)
        self._staged.clear()

    def discard(self) -> None:
        for staged in self._staged.values():
            if staged.is_dir():
                shutil.rmtree(staged, ignore_errors=True)
            else:
                staged.unlink(missing_ok=True)
        self._staged.clear()


@contextmanager
def all_or_nothing(paths: Mapping[str, str | Path]) -> Iterator[OutputSet]:
    """`with all_or_nothing(outputs) as out: out.parquet(...)`; committed only if the block ends."""
    staged = OutputSet(paths)
    try:
        yield staged
        staged.commit()
    finally:
        staged.discard()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------
# Entry: Snakemake or the command line, one shape
# ---------------------------------------------------------------------------------------------


def call_stage(
    run: StageRun,
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str],
    cfg: WorkflowConfig,
    log: logging.Logger,
) -> int:
    """Run a stage; a ProbeError or a config error becomes one logged message and exit code 1."""
    try:
        run(inputs, outputs, cfg)
    except ProbeError as error:
        log.error("%s", error)
        return 1
    return 0


def _snakemake_inputs(smk: Any) -> dict[str, Any]:
    return {key: smk.input[key] for key in smk.input.keys()}


def _parse_cli(
    stage: str, description: str, argv: Sequence[str] | None, default_inputs: Mapping[str, str]
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=description,
        epilog=(
            "Inputs and outputs default to the workflow's layout under --results; override one "
            "with --input KEY=PATH / --output KEY=PATH, a config value with --set "
            "section.key=YAML (e.g. --set training.max_seq_len=2048). "
            f"Input keys: {', '.join(default_inputs) or 'none'}. "
            f"Output keys: {', '.join(stage_outputs(stage))}."
        ),
    )
    parser.add_argument(
        "--configfile", default=None, help="config YAML (default config/config.yaml)"
    )
    parser.add_argument(
        "--results", default=RESULTS_DIR, help="results directory (default results)"
    )
    parser.add_argument("--input", action="append", default=[], metavar="KEY=PATH")
    parser.add_argument("--output", action="append", default=[], metavar="KEY=PATH")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=YAML")
    parser.add_argument("--log", default=None, help="also log to this file")
    parser.add_argument(
        "--allow-config-mismatch",
        action="store_true",
        help="use upstream outputs written with other values of the config sections they read",
    )
    return parser.parse_args(argv)


# Every stage reads these sections, plus its own (named as its stage).
SHARED_SECTIONS = ("model", "data", "training")


def upstream_config_mismatches(
    inputs: Mapping[str, Any], results_dir: str, config: Mapping[str, Any]
) -> list[str]:
    """Each upstream Parquet input whose recorded config disagrees with `config` in a section
    that its stage reads (SHARED_SECTIONS + the stage's own), naming both hashes."""
    from probes.contracts import STAGE_OUTPUTS

    owners = {
        str(Path(path)): stage
        for stage in STAGE_OUTPUTS
        for path in stage_outputs(stage, results_dir).values()
    }
    problems = []
    for key, value in inputs.items():
        path = Path(value) if isinstance(value, str | Path) else None
        stage = owners.get(str(path)) if path is not None else None
        if stage is None or path.suffix != ".parquet" or not path.is_file():
            continue
        recorded = io.read_provenance(path).get("config_section_hashes") or {}
        for section in (*SHARED_SECTIONS, stage):
            mine = io.config_hash({section: config.get(section)}) if section in config else None
            theirs = recorded.get(section)
            if theirs is not None and mine is not None and theirs != mine:
                problems.append(
                    f"--input {key}={path}: written by the {stage} stage with config section "
                    f"'{section}' hash {theirs}, this run's is {mine}"
                )
    return problems


def _pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {value!r}: expected KEY=VALUE")
        pairs[key] = rest
    return pairs


def main(
    stage: str,
    run: StageRun,
    description: str,
    namespace: Mapping[str, Any],
    inputs_for: Callable[[WorkflowConfig, str], dict[str, Any]] | None = None,
    argv: Sequence[str] | None = None,
) -> None:
    """The whole body of a stage script: `main("bucket", stage.run, __doc__, globals())`.

    Under Snakemake the rule's named inputs, outputs, log and config are used; standalone, the
    inputs come from the contract (`probes.config.stage_inputs`, what the rule declares too) or
    from `inputs_for(cfg, results_dir)`, and the outputs from the contract.
    """
    if inputs_for is None:
        from probes.config import stage_inputs

        def inputs_for(cfg: WorkflowConfig, results: str) -> dict[str, Any]:
            return stage_inputs(stage, cfg.raw, results)

    smk = namespace.get("snakemake")
    if smk is not None:
        log = setup_logging(smk.log[0] if smk.log else None, f"probes.{stage}")
        # The Rust tokenizer sizes its thread pool once, at first use: honour the rule's threads.
        os.environ.setdefault("RAYON_NUM_THREADS", str(smk.threads))
        os.environ[RULE_THREADS_ENV] = str(smk.threads)  # what a timing stage may use
        cfg = WorkflowConfig.from_dict(dict(smk.config))
        outputs = {key: str(smk.output[key]) for key in smk.output.keys()}
        sys.exit(call_stage(run, _snakemake_inputs(smk), outputs, cfg, log))
    if namespace.get("__name__") != "__main__":
        return
    from probes.config import ConfigError, check_config_paths, load_config

    args = _parse_cli(stage, description, argv, _default_inputs(inputs_for))
    log = setup_logging(args.log, f"probes.{stage}")
    try:
        raw = load_config(args.configfile, overrides=_pairs(args.set, "--set"))
        check_config_paths(raw)
    except ConfigError as error:
        log.error("%s", error)
        sys.exit(1)
    cfg = WorkflowConfig.from_dict(raw)
    inputs = {**inputs_for(cfg, args.results), **_pairs(args.input, "--input")}
    outputs = {**stage_outputs(stage, args.results), **_pairs(args.output, "--output")}
    unknown = sorted(set(_pairs(args.output, "--output")) - set(stage_outputs(stage)))
    if unknown:
        log.error("--output keys %s unknown; known: %s", unknown, list(stage_outputs(stage)))
        sys.exit(1)
    mismatches = upstream_config_mismatches(inputs, args.results, cfg.raw)
    if mismatches and not args.allow_config_mismatch:
        log.error(
            "upstream output(s) from another config: %s; rerun those stages with this config, "
            "or pass --allow-config-mismatch to use them anyway.",
            "; ".join(mismatches),
        )
        sys.exit(1)
    for problem in mismatches:
        log.warning("%s (--allow-config-mismatch)", problem)
    sys.exit(call_stage(run, inputs, outputs, cfg, log))


def _default_inputs(
    inputs_for: Callable[[WorkflowConfig, str], dict[str, Any]],
) -> dict[str, Any]:
    """The stage's inputs under the default config, for --help (empty if it cannot load)."""
    from probes.config import ConfigError, load_config

    try:
        return inputs_for(WorkflowConfig.from_dict(load_config(None)), RESULTS_DIR)
    except ConfigError:
        return {}


__all__ = [
    "ControlFailedError",
    "OutputSet",
    "ProbeError",
    "all_or_nothing",
    "call_stage",
    "main",
    "report_inputs",
]
