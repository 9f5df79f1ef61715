"""Replay: measured epoch time of every batching strategy (a stratified sample of its real
micro-batches through the harness), with bootstrap intervals, a scaling fit over the data's own
lengths, and a positive control on a synthetic harness of known cost.

Run by `snakemake replay`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/step_replay.py --model-path resources/model/gemma-3-270m --device cuda
"""

import argparse
import sys
from pathlib import Path
from typing import Any

if "snakemake" in globals():  # Snakemake runs a copy of this file from .snakemake/scripts
    sys.path.insert(0, str(Path(snakemake.scriptdir)))  # type: ignore[name-defined]  # noqa: F821
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes.logs import setup_logging  # noqa: E402
from probes.replay_stage import OUTPUT_FILES  # noqa: E402

SECTIONS = ("replay", "profile", "training")


def main(
    inputs: dict[str, str],
    outputs: dict[str, str],
    config: dict[str, Any],
    model_path: str,
    log_path: str | None,
) -> int:
    log = setup_logging(log_path, "probes.replay")
    from probes.gpu_guard import CardBusyError
    from probes.harness import HarnessError
    from probes.plans import PlanInputError
    from probes.profile_stage import ProfileError
    from probes.replay_stage import ReplayError, run

    try:
        summary = run(inputs, outputs, config, model_path)
    except (ReplayError, ProfileError, HarnessError, PlanInputError, CardBusyError) as error:
        log.error("%s", error)
        return 1
    log.info("replay summary: %s", summary)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="resources/model/gemma-3-270m")
    parser.add_argument("--plans", default="results/bucket/plans.parquet")
    parser.add_argument("--lengths", default="results/padding/lengths.parquet")
    parser.add_argument("--recommendation", default="results/bucket/recommendation.json")
    parser.add_argument("--gate", default="results/mask/gate.json")
    parser.add_argument(
        "--configfile", default=None, help="config YAML (default: config/config.yaml)"
    )
    parser.add_argument("--out-dir", default="results/profile", help="where the outputs go")
    parser.add_argument("--log", default=None, help="log file (stderr always)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None)
    parser.add_argument("--harness", default=None, help=".py path or import path")
    return parser.parse_args(argv)


if __name__ == "__main__" and "snakemake" not in globals():
    from probes.config import ConfigError, load_config

    cli = parse_args()
    try:
        standalone = load_config(cli.configfile)
    except ConfigError as error:
        sys.exit(f"replay: {error}")
    if cli.device:
        standalone["profile"]["device"] = cli.device
    if cli.harness:
        standalone["profile"]["harness"] = cli.harness
    paths = {key: str(Path(cli.out_dir) / name) for key, name in OUTPUT_FILES.items()}
    ins = {k: getattr(cli, k) for k in ("plans", "lengths", "recommendation", "gate")}
    sys.exit(main(ins, paths, standalone, cli.model_path, cli.log))

if "snakemake" in globals():
    from probes.config import SCHEMA, fill_defaults, load_yaml  # noqa: E402

    sm = snakemake  # type: ignore[name-defined]  # noqa: F821
    schema = load_yaml(SCHEMA)["properties"]
    # the whole workflow config (hashed into the outputs), the sections read here default-filled
    stage = {**dict(sm.config)}
    for section in SECTIONS:
        stage[section] = fill_defaults(dict(sm.config.get(section) or {}), schema[section])
    code = main(
        {key: getattr(sm.input, key) for key in ("plans", "lengths", "recommendation", "gate")},
        {key: getattr(sm.output, key) for key in OUTPUT_FILES},
        stage,
        sm.params.model_path,
        sm.log[0],
    )
    if code:
        sys.exit(code)
