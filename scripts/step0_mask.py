"""Mask gate: per decoder layer, the mask band and the SDPA backend, from the model's config.json.

Needs no weights and no GPU. Run by the `mask` rule, or standalone:

    python scripts/step0_mask.py --model-config config/models/gemma-3-27b-it/config.json \\
        --outdir results/mask --micro-batch-size 2 --max-seq-len 4096
"""

import argparse
import sys
from pathlib import Path
from typing import Any

# standalone: the package sits beside this file (Snakemake appends scripts/ to sys.path itself)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes.io import run_metadata, write_json, write_parquet  # noqa: E402
from probes.logs import setup_logging  # noqa: E402


def main(
    model_config: str,
    out_layers: str,
    out_gate: str,
    out_control: str,
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    config_for_provenance: dict[str, Any],
    log_path: str | None = None,
) -> int:
    log = setup_logging(log_path, "probes.mask")
    # imported late so that --help stays instant
    from probes.mask import GateError, merged_mask_config, run_gate
    from probes.mask_trace import ModelConfigError, read_config_json

    merged = merged_mask_config(mask_cfg)
    try:
        config_dict = read_config_json(model_config)
        layers, gate, control = run_gate(config_dict, merged, training_cfg, source=model_config)
    except (ModelConfigError, GateError, ValueError) as error:
        log.error("mask gate: %s", error)
        return 1
    log.info("%s", gate["headline"] or "no training-shape scenario")
    for scenario in gate["scenarios"]:
        log.info(
            "scenario %-15s B=%d T=%-6d fast path %d/%d, backends %s, violations %d",
            scenario["scenario"],
            scenario["batch"],
            scenario["seq_len"],
            scenario["layers_fast_path"],
            scenario["layers"],
            scenario["backends"],
            scenario["violations"],
        )
    for note in gate["notes"]:
        log.info("note: %s", note)
    log.info("confirmation: %s", gate["confirm"]["note"])
    if not gate["passed"]:
        for violation in gate["violations"]:
            log.error("violation: %s", violation)
        log.error(
            "mask gate FAILED: %d layer/scenario pairs differ from the configured pattern "
            "(first: %s)",
            gate["violations_total"],
            gate["violations"][0] if gate["violations"] else "-",
        )
        if merged["fail_on_violation"]:
            return 1
    provenance = run_metadata(config_for_provenance)
    gate["model_config"] = str(model_config)
    gate["provenance"] = provenance
    write_parquet(layers, out_layers, provenance=provenance)
    write_json(control, out_control)
    write_json(gate, out_gate)
    log.info(
        "mask gate %s in %.1f s", "passed" if gate["passed"] else "FAILED", gate["wall_seconds"]
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", required=True, help="the model's config.json")
    parser.add_argument(
        "--outdir",
        default="results/mask",
        help="where layers.parquet, gate.json and control.json go (default: results/mask)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--compute-capability", default="9.0", help="target GPU, e.g. 9.0 or 8.0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cudnn-version", type=int, default=None, help="e.g. 91002 for 9.10.2")
    parser.add_argument(
        "--expected-sliding-window",
        type=int,
        default=None,
        help="assert this window instead of the config's (to test the gate)",
    )
    parser.add_argument("--scenarios", nargs="+", default=None, help="subset of scenarios to run")
    parser.add_argument(
        "--no-fail",
        action="store_true",
        help="write the outputs even when the gate finds violations",
    )
    parser.add_argument("--log", default=None, help="log file (stderr always)")
    return parser.parse_args(argv)


if __name__ == "__main__" and "snakemake" not in globals():
    args = parse_args()
    mask_cfg: dict[str, Any] = {
        "target_compute_capability": args.compute_capability,
        "dtype": args.dtype,
        "cudnn_version": args.cudnn_version,
        "expected_sliding_window": args.expected_sliding_window,
        "fail_on_violation": not args.no_fail,
    }
    if args.scenarios:
        mask_cfg["scenarios"] = args.scenarios
    training_cfg = {"micro_batch_size": args.micro_batch_size, "max_seq_len": args.max_seq_len}
    outdir = Path(args.outdir)
    sys.exit(
        main(
            args.model_config,
            str(outdir / "layers.parquet"),
            str(outdir / "gate.json"),
            str(outdir / "control.json"),
            mask_cfg,
            training_cfg,
            {"model_config": args.model_config, "mask": mask_cfg, "training": training_cfg},
            args.log,
        )
    )

if "snakemake" in globals():
    smk = globals()["snakemake"]
    sys.exit(
        main(
            smk.input.model_config,
            smk.output.layers,
            smk.output.gate,
            smk.output.control,
            dict(smk.params.mask),
            dict(smk.params.training),
            dict(smk.config),
            smk.log[0] if smk.log else None,
        )
    )
