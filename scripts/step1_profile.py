"""Profile: step-time scaling fit, padding penalty, CE wall clock, kernel table (GPU; CPU fallback).

Run by `snakemake profile`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/step1_profile.py --model-path resources/model/gemma-3-270m \\
        --lengths results/padding/lengths.parquet --out-dir results/profile --device cuda
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
from probes.profile_stage import OUTPUT_FILES  # noqa: E402


def main(
    lengths: str,
    recommendation: str | None,
    model_path: str,
    outputs: dict[str, str],
    config: dict[str, Any],
    log_path: str | None,
) -> int:
    log = setup_logging(log_path, "probes.profile")
    from probes.batches import LengthsError
    from probes.gpu_guard import CardBusyError
    from probes.harness import HarnessError
    from probes.profile_stage import ProfileError, run_profile

    try:
        summary = run_profile(lengths, recommendation, model_path, outputs, config)
    except (ProfileError, HarnessError, LengthsError, CardBusyError) as error:
        log.error("%s", error)
        return 1
    log.info("profile summary: %s", summary)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="resources/model/gemma-3-270m")
    parser.add_argument("--lengths", default="results/padding/lengths.parquet")
    parser.add_argument(
        "--recommendation",
        default="results/bucket/recommendation.json",
        help="bucket recommendation (optional, recorded in the provenance when present)",
    )
    parser.add_argument(
        "--configfile", default=None, help="config YAML (default: config/config.yaml)"
    )
    parser.add_argument("--out-dir", default="results/profile", help="default for every output")
    for key, name in OUTPUT_FILES.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}-out",
            dest=f"out_{key}",
            default=None,
            help=f"default: OUT_DIR/{name}",
        )
    parser.add_argument("--log", default=None, help="log file (stderr always)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None)
    parser.add_argument(
        "--seq-lengths",
        type=int,
        nargs="+",
        default=None,
        help="scaling lengths for the chosen device (>= 3)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--kernel-steps", type=int, default=None)
    parser.add_argument("--harness", default=None, help=".py path or import path")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="seconds to wait for an idle card before failing",
    )
    return parser.parse_args(argv)


def standalone_config(args: argparse.Namespace) -> dict[str, Any]:
    from probes.config import load_config

    config = load_config(args.configfile)
    profile = config["profile"]
    if args.device:
        profile["device"] = args.device
    if args.harness:
        profile["harness"] = args.harness
    if args.micro_batch_size:
        profile["micro_batch_size"] = args.micro_batch_size
    if args.peak_tflops:
        profile["peak_tflops"] = args.peak_tflops
    if args.idle_timeout is not None:
        profile["idle"]["timeout_s"] = args.idle_timeout
    for section in ("cuda", "cpu"):  # the device is only known at run time: override both
        for key in ("warmup", "repeats", "kernel_steps"):
            if getattr(args, key) is not None:
                profile[section][key] = getattr(args, key)
        if args.seq_lengths:
            profile[section]["lengths"] = args.seq_lengths
    return config


if __name__ == "__main__" and "snakemake" not in globals():
    cli = parse_args()
    paths = {
        key: getattr(cli, f"out_{key}") or str(Path(cli.out_dir) / name)
        for key, name in OUTPUT_FILES.items()
    }
    from probes.config import ConfigError

    try:
        standalone = standalone_config(cli)
    except ConfigError as error:
        sys.exit(f"profile: {error}")
    sys.exit(main(cli.lengths, cli.recommendation, cli.model_path, paths, standalone, cli.log))

if "snakemake" in globals():
    from probes.config import SCHEMA, fill_defaults, load_yaml  # noqa: E402

    sm = snakemake  # type: ignore[name-defined]  # noqa: F821
    sections = load_yaml(SCHEMA)["properties"]
    # the whole workflow config (as the other stages hash it), its two sections default-filled
    stage = {
        **dict(sm.config),
        "profile": fill_defaults(dict(sm.params.profile), sections["profile"]),
        "training": fill_defaults(dict(sm.params.training), sections["training"]),
    }
    code = main(
        sm.input.lengths,
        sm.input.recommendation,
        sm.params.model_path,
        {key: getattr(sm.output, key) for key in OUTPUT_FILES},
        stage,
        sm.log[0],
    )
    if code:
        sys.exit(code)
