"""Bucket sweep: how much length-grouped batching saves, at which bucket size, what it costs in
source diversity, and how it compares with packing.

Reads the padding stage's lengths (status OK and TRUNCATED rows; EMPTY and ERROR are counted and
skipped), runs the positive control, sweeps bucket sizes × seeds, checks the sweep did not
collapse, and writes results/bucket/{sweep.parquet, recommendation.json, control.json,
plans.parquet}.

Run by Snakemake (`snakemake bucket_sweep`) or standalone:
    python scripts/step_bucket.py --lengths results/padding/lengths.parquet --out-dir results/bucket
"""

# No `from __future__` import: Snakemake prepends its preamble to the script, and such an import
# must be the file's first statement.
import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `probes` beside this script

from probes import bucket, plans  # noqa: E402
from probes.config import DEFAULT_CONFIG, ConfigError, load_config  # noqa: E402
from probes.io import config_hash, run_metadata, write_json, write_parquet  # noqa: E402
from probes.logs import setup_logging  # noqa: E402


class ControlFailedError(RuntimeError):
    """The positive control did not recover its known answer: the instrument is not trusted."""


def main(
    lengths_path: str | Path,
    out_sweep: str | Path,
    out_recommendation: str | Path,
    out_control: str | Path,
    bucket_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    config: dict[str, Any],
    log: logging.Logger,
    progress: bool = True,
    out_plans: str | Path | None = None,
) -> dict[str, Any]:
    """Run the stage; every output is written only after every check has passed."""
    started = time.perf_counter()
    control = bucket.run_control()
    if not control["passed"]:
        raise ControlFailedError(
            "positive control failed: expected "
            f"{control['expected']} observed {control['observed']}; the sweep would not be "
            "trustworthy, no output written"
        )
    log.info("positive control passed (%.1f s)", time.perf_counter() - started)

    micro = int(training_cfg["micro_batch_size"])
    grad_accum = int(training_cfg["grad_accum"])
    max_seq_len = int(training_cfg["max_seq_len"])
    data = bucket.read_lengths(lengths_path, max_seq_len)
    counts = data.status_counts
    log.info(
        "lengths: %d examples used (OK %d, TRUNCATED %d), skipped EMPTY %d, ERROR %d; "
        "%d source(s)%s",
        data.lengths.size,
        counts["OK"],
        counts["TRUNCATED"],
        counts["EMPTY"],
        counts["ERROR"],
        data.n_sources,
        "" if data.sources_known else " (unknown: diversity is trivially 1.0)",
    )
    sweep = bucket.sweep_bucket_sizes(
        data,
        micro_batch_size=micro,
        grad_accum=grad_accum,
        max_seq_len=max_seq_len,
        seeds=bucket_cfg["seeds"],
        bucket_sizes=bucket_cfg["bucket_sizes"],
        packing=bucket_cfg["packing"],
        progress=progress,
    )
    guard = bucket.assert_sweep_varies(sweep, data, micro)
    log.info("collapse guard: %s (spread %.4f)", guard["reason"], guard["efficiency_spread"])
    recommendation = bucket.recommend(
        sweep,
        gain_share=float(bucket_cfg["gain_share"]),
        min_diversity_share=float(bucket_cfg["min_diversity_share"]),
        gain_metric=bucket_cfg["gain_metric"],
        diversity_level=bucket_cfg["diversity_level"],
    )
    recommendation["input"] = {
        "lengths": str(lengths_path),
        "examples_used": int(data.lengths.size),
        "rows_used": {s: counts[s] for s in bucket.USED_STATUSES},
        "rows_skipped": {s: counts[s] for s in bucket.SKIPPED_STATUSES},
        "n_sources": data.n_sources,
        "sources_known": data.sources_known,
        "real_tokens": int(data.lengths.sum()),
    }
    recommendation["training"] = {
        "micro_batch_size": micro,
        "grad_accum": grad_accum,
        "max_seq_len": max_seq_len,
    }
    recommendation["seeds"] = [int(s) for s in bucket_cfg["seeds"]]
    recommendation["bucket_sizes"] = sorted(
        int(m) for m in sweep["bucket_size_batches"].dropna().unique()
    )
    recommendation["collapse_guard"] = {
        k: guard[k] for k in ("applicable", "reason", "efficiency_spread", "problems")
    }
    # No date or command line here, so the JSON is byte-identical across reruns; the Parquet's
    # file metadata carries the full provenance.
    recommendation["config_hash"] = config_hash(config)

    write_parquet(sweep, out_sweep, provenance=run_metadata(config))
    if out_plans is not None:  # every strategy's micro-batches, for the replay (issue 12)
        plans.write_plans_for_bucket_stage(
            lengths_path,
            recommendation,
            training_cfg,
            out_plans,
            run_metadata(config),
            seed=int(bucket_cfg["seeds"][0]),
        )
    write_json(recommendation, out_recommendation)
    write_json(control, out_control)
    chosen = recommendation["recommended"]
    log.info(
        "recommended bucket size %d micro-batches (%s): token efficiency %.3f (random %.3f), "
        "saves %.1f%% of padded tokens, diversity %.3f of random; %.1f s",
        chosen["bucket_size_batches"],
        recommendation["status"],
        chosen["token_efficiency"],
        recommendation["random"]["token_efficiency"],
        100 * chosen["padded_tokens_saved_vs_random"],
        chosen["diversity_rel_random"],
        time.perf_counter() - started,
    )
    return recommendation


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Bucket sweep: padding saved by length-grouped batching per bucket size (HF "
            "get_length_grouped_indices semantics), source diversity cost, packing comparison."
        )
    )
    parser.add_argument(
        "--configfile",
        type=Path,
        default=DEFAULT_CONFIG,
        help="workflow config (bucket and training sections are used)",
    )
    parser.add_argument(
        "--lengths",
        type=Path,
        default=Path("results/padding/lengths.parquet"),
        help="the padding stage's lengths table",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("results/bucket"),
        help="writes sweep.parquet, recommendation.json, control.json here",
    )
    parser.add_argument("--log", type=Path, default=None, help="also log to this file")
    parser.add_argument("--seeds", type=int, nargs="+", help="override bucket.seeds")
    parser.add_argument(
        "--bucket-sizes", type=int, nargs="+", help="override bucket.bucket_sizes (micro-batches)"
    )
    parser.add_argument("--micro-batch-size", type=int, help="override training.micro_batch_size")
    parser.add_argument("--grad-accum", type=int, help="override training.grad_accum")
    parser.add_argument("--max-seq-len", type=int, help="override training.max_seq_len")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    log = setup_logging(args.log, "bucket_sweep")
    try:
        config = load_config(args.configfile)
        overrides = {
            ("bucket", "seeds"): args.seeds,
            ("bucket", "bucket_sizes"): args.bucket_sizes,
            ("training", "micro_batch_size"): args.micro_batch_size,
            ("training", "grad_accum"): args.grad_accum,
            ("training", "max_seq_len"): args.max_seq_len,
        }
        for (section, key), value in overrides.items():
            if value is not None:
                config[section][key] = value
        main(
            args.lengths,
            args.out_dir / "sweep.parquet",
            args.out_dir / "recommendation.json",
            args.out_dir / "control.json",
            config["bucket"],
            config["training"],
            config,
            log,
            progress=not args.no_progress,
            out_plans=args.out_dir / "plans.parquet",
        )
    except (
        bucket.LengthsInputError,
        bucket.SweepCollapsedError,
        ControlFailedError,
        ConfigError,
        plans.PlanInputError,
    ) as error:
        log.error("%s", error)
        return 1
    return 0


if "snakemake" in globals():
    _smk = globals()["snakemake"]
    _log = setup_logging(_smk.log[0] if _smk.log else None, "bucket_sweep")
    try:
        main(
            _smk.input.lengths,
            _smk.output.sweep,
            _smk.output.recommendation,
            _smk.output.control,
            _smk.params.bucket,
            _smk.params.training,
            _smk.config,
            _log,
            out_plans=_smk.output.plans,
        )
    except (
        bucket.LengthsInputError,
        bucket.SweepCollapsedError,
        ControlFailedError,
        ConfigError,
        plans.PlanInputError,
    ) as error:
        _log.error("%s", error)
        sys.exit(1)
elif __name__ == "__main__":
    sys.exit(cli())
