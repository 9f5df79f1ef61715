"""The bucket_sweep stage: control, sweep, collapse guard, recommendation, written all together."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.batching import packing, plans, ranks, rebalance
from probes.bucket import control as bucket_controls
from probes.bucket import data_parallel as dp
from probes.bucket import guard
from probes.bucket import sweep as bucket
from probes.contracts import SKIPPED_STATUSES, TRAINING_STATUSES
from probes.io import config_hash, run_metadata
from probes.lengths import LengthsError, LengthSet, read_lengths
from probes.settings import WorkflowConfig
from probes.stage import ControlFailedError, ProbeError, all_or_nothing

LOG = logging.getLogger("probes.bucket.sweep")


def run(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str],
    cfg: WorkflowConfig,
    progress: bool = True,
) -> None:
    """Every output is written only after every check has passed."""
    started = time.perf_counter()
    control = run_control()  # fails fast, before the user's lengths are read
    data = read_data(inputs["lengths"], cfg.training.max_seq_len)
    # TRL's rows, packed once: the sweep, the data-parallel sweep and the plans share them
    packed = packing.pack_all(data.lengths, cfg.training.max_seq_len, cfg.bucket.packing)
    sweep, data_parallel = run_sweeps(data, packed, cfg, progress)
    checked = check_sweep(sweep, data, cfg.training.micro_batch_size)
    recommendation = recommend(sweep, data_parallel, cfg)
    recommendation.update(provenance(inputs, data, sweep, checked, cfg))
    write_all(outputs, inputs, cfg, sweep, data_parallel, recommendation, control, packed)
    log_recommendation(recommendation, time.perf_counter() - started)


def run_control() -> dict[str, Any]:
    """The positive control; ControlFailedError (no output written) when it fails."""
    started = time.perf_counter()
    control = bucket_controls.run_control()
    if not control["passed"]:
        raise ControlFailedError(
            "positive control failed: expected "
            f"{control['expected']} observed {control['observed']}; the sweep would not be "
            "trustworthy, no output written"
        )
    LOG.info("positive control passed (%.1f s)", time.perf_counter() - started)
    return control


def read_data(path: str, max_seq_len: int) -> LengthSet:
    """The padding stage's lengths (OK and TRUNCATED), the skipped rows counted in the log."""
    try:
        data = read_lengths(path, max_seq_len)
    except LengthsError as error:
        raise ProbeError(str(error)) from error
    counts = data.status_counts
    LOG.info(
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
    return data


def run_sweeps(
    data: LengthSet,
    packed: Mapping[str, packing.PackedRows],
    cfg: WorkflowConfig,
    progress: bool,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The single-device sweep and its data-parallel view, over the same sizes and seeds."""
    training, settings = cfg.training, cfg.bucket
    common = {
        "micro_batch_size": training.micro_batch_size,
        "grad_accum": training.grad_accum,
        "max_seq_len": training.max_seq_len,
        "seeds": list(settings.seeds),
        "bucket_sizes": None if settings.bucket_sizes is None else list(settings.bucket_sizes),
        "packing": list(settings.packing),
        "packed": packed,
    }
    sweep = bucket.sweep_bucket_sizes(data, progress=progress, **common)
    world_sizes = ranks.world_sizes_for(training.world_size)
    data_parallel = dp.data_parallel_sweep(data, world_sizes=world_sizes, **common)
    return sweep, data_parallel


def check_sweep(sweep: pd.DataFrame, data: LengthSet, micro_batch_size: int) -> dict[str, Any]:
    """The collapse guard (probes.bucket.guard); a collapsed sweep fails the stage."""
    try:
        checked = guard.assert_sweep_varies(sweep, data, micro_batch_size)
    except guard.SweepCollapsedError as error:
        raise ProbeError(str(error)) from error
    LOG.info("collapse guard: %s (spread %.4f)", checked["reason"], checked["efficiency_spread"])
    return checked


def recommend(
    sweep: pd.DataFrame, data_parallel: pd.DataFrame, cfg: WorkflowConfig
) -> dict[str, Any]:
    """The recommendation at the configured thresholds and world size."""
    settings = cfg.bucket
    return bucket.recommend(
        sweep,
        gain_share=settings.gain_share,
        min_diversity_share=settings.min_diversity_share,
        gain_metric=settings.gain_metric,
        diversity_level=settings.diversity_level,
        data_parallel=data_parallel,
        world_size=cfg.training.world_size,
    )


def provenance(
    inputs: Mapping[str, Any],
    data: LengthSet,
    sweep: pd.DataFrame,
    checked: dict[str, Any],
    cfg: WorkflowConfig,
) -> dict[str, Any]:
    """What the recommendation was computed from: input, settings, guard, config hash."""
    training = cfg.training
    counts = data.status_counts
    rebalance_skipped = rebalance.skip_reason(int(data.lengths.size), training.grad_accum)
    if rebalance_skipped is not None:
        LOG.warning("%s", rebalance_skipped)
    return {
        "batch_rebalance_not_run": rebalance_skipped,
        "input": {
            "lengths": str(inputs["lengths"]),
            "examples_used": int(data.lengths.size),
            "rows_used": {s: counts[s] for s in TRAINING_STATUSES},
            "rows_skipped": {s: counts[s] for s in SKIPPED_STATUSES},
            "n_sources": data.n_sources,
            "sources_known": data.sources_known,
            "real_tokens": int(data.lengths.sum()),
        },
        "training": {
            "micro_batch_size": training.micro_batch_size,
            "grad_accum": training.grad_accum,
            "max_seq_len": training.max_seq_len,
        },
        "seeds": [int(s) for s in cfg.bucket.seeds],
        "bucket_sizes": sorted(int(m) for m in sweep["bucket_size_batches"].dropna().unique()),
        "collapse_guard": {
            k: checked[k] for k in ("applicable", "reason", "efficiency_spread", "problems")
        },
        # No date or command line here, so the JSON is byte-identical across reruns; the
        # Parquet's file metadata carries the full provenance.
        "config_hash": config_hash(dict(cfg.raw)),
    }


def write_all(
    outputs: Mapping[str, str],
    inputs: Mapping[str, Any],
    cfg: WorkflowConfig,
    sweep: pd.DataFrame,
    data_parallel: pd.DataFrame,
    recommendation: dict[str, Any],
    control: dict[str, Any],
    packed: Mapping[str, packing.PackedRows],
) -> None:
    """Every output, all or nothing."""
    summary = bucket.summarise(sweep, cfg.bucket.diversity_level)
    meta = run_metadata(dict(cfg.raw))
    with all_or_nothing(outputs) as out:
        out.parquet("sweep", sweep, meta)
        out.parquet("summary", summary, meta)
        if "data_parallel" in outputs:  # straggler cost per strategy at W = 1, 2, 4, 8 ranks
            out.parquet("data_parallel", data_parallel, meta)
        out.json("recommendation", recommendation)
        out.json("control", control)
        if "plans" in outputs:  # every strategy's micro-batches for one seed (the replay's input)
            seed = int(cfg.bucket.seeds[0])
            frame = plans.bucket_stage_plans(
                inputs["lengths"], recommendation, cfg.training, seed, packed.get(packing.BFD)
            )
            out.parquet("plans", frame, {**meta, "plan_seed": seed})


def log_recommendation(recommendation: dict[str, Any], seconds: float) -> None:
    chosen = recommendation["recommended"]
    LOG.info(
        "recommended bucket size %d micro-batches (%s): token efficiency %.3f (random %.3f), "
        "saves %.1f%% of padded tokens, diversity %.3f of random; %.1f s",
        chosen["bucket_size_batches"],
        recommendation["status"],
        chosen["token_efficiency"],
        recommendation["random"]["token_efficiency"],
        100 * chosen["padded_tokens_saved_vs_random"],
        chosen["diversity_rel_random"],
        seconds,
    )
