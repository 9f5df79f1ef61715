"""Tables and JSON files: the columns and keys each must have; the check a reader runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from probes.errors import ProbeError

# ---------------------------------------------------------------------------------------------
# Tables: the columns each one must have (required) and may have (optional). A reader that gets a
# file without a required column fails naming file, columns and section.
# ---------------------------------------------------------------------------------------------

# lengths.parquet: one row per example, every status, in data order.
LENGTH_COLUMNS = (
    "example_id",
    "file",
    "row",
    "source",
    "status",
    "reason",
    "n_tokens",
    "n_tokens_full",
    "n_loss_tokens",
    "n_turns",
    "n_truncated_tokens",
)


@dataclass(frozen=True)
class TableSpec:
    stage: str
    section: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


TABLES: dict[str, TableSpec] = {
    "mask_layers": TableSpec(
        "mask",
        "Mask gate",
        (
            "scenario",
            "batch",
            "seq_len",
            "padding",
            "packed",
            "layer_idx",
            "layer_type",
            "head_dim",
            "mask_present",
            "is_causal",
            "band_lower",
            "band_upper",
            "backend",
            "excluded_by",
        ),
        ("fast_path", "violation", "band_source"),
    ),
    # one row per example, every status (probes.padding.tokenize.LENGTH_COLUMNS)
    "padding_lengths": TableSpec(
        "padding",
        "Padding",
        ("example_id", "source", "status", "reason", "n_tokens", "n_loss_tokens"),
        ("n_truncated_tokens", "n_tokens_full", "n_turns"),
    ),
    # long format: section waste (strategy x metric), status (status x metric), reason
    "padding_summary": TableSpec(
        "padding",
        "Padding",
        ("section", "strategy", "status", "reason", "metric", "value", "std"),
        ("expected", "n_seeds", "n_batches", "micro_batch_size", "max_seq_len"),
    ),
    # long format: scope/source/measure, kind stat (statistic) or bin (bin_lo, bin_hi)
    "padding_distribution": TableSpec(
        "padding",
        "Padding",
        ("scope", "source", "measure", "kind", "statistic", "bin_lo", "bin_hi", "value"),
    ),
    "padding_ce_chunks": TableSpec(
        "padding",
        "Cross-entropy",
        (
            "shape",
            "seq_len",
            "tokens",
            "vocab_source",
            "vocab_size",
            "hidden_size",
            "logits_bf16_bytes",
            "logits_fp32_bytes",
            "stock_loss_bytes",
            "chunk_tokens",
            "n_chunks",
            "liger_chunk_tokens",
        ),
        ("budget_gib", "stock_fits_budget", "chunk_bytes", "liger_n_chunks", "liger_fits_budget"),
    ),
    "bucket_sweep": TableSpec(
        "bucket",
        "Bucketing",
        (
            "strategy",
            "bucket_size_batches",
            "seed",
            "token_efficiency",
            "attention_efficiency",
            "n_micro_batches",
            "micro_distinct_sources_rel_random",
            "micro_source_entropy_rel_random",
            "step_distinct_sources_rel_random",
            "step_source_entropy_rel_random",
            "order_length_spearman",
        ),
        ("n_steps", "is_hf_trainer_default", "padded_tokens_saved_vs_random"),
    ),
    # mean over seeds per strategy x bucket size, in STRATEGY_ORDER (probes.bucket.sweep.summarise)
    "bucket_summary": TableSpec(
        "bucket",
        "Bucketing",
        (
            "strategy",
            "bucket_size_batches",
            "n_seeds",
            "token_efficiency",
            "token_efficiency_std",
            "attention_efficiency",
            "attention_efficiency_std",
            "n_micro_batches",
            "micro_distinct_sources_rel_random",
            "micro_source_entropy_rel_random",
            "step_distinct_sources_rel_random",
            "step_source_entropy_rel_random",
            "diversity_rel_random",
            "order_length_spearman",
        ),
        ("is_hf_trainer_default", "padded_tokens_saved_vs_random"),
    ),
    # per strategy x bucket size x seed x world size: sum over optimizer steps of the slowest
    # rank's padded tokens / dense attention cost (step_max), of the mean over ranks (step_mean),
    # max / mean - 1 (straggler), and the max's saving vs random at the same W and seed
    "bucket_data_parallel": TableSpec(
        "bucket",
        "Bucketing",
        (
            "strategy",
            "bucket_size_batches",
            "seed",
            "world_size",
            "n_steps",
            "padded_tokens_step_max",
            "padded_tokens_step_mean",
            "padded_tokens_straggler",
            "attention_cost_step_max",
            "attention_cost_step_mean",
            "attention_cost_straggler",
            "dp_padded_tokens_saved_vs_random",
            "dp_attention_cost_saved_vs_random",
        ),
        ("micro_batches_per_rank",),
    ),
    "profile_scaling": TableSpec(
        "profile",
        "Scaling",
        # mfu: model FLOPs under the LoRA convention (provenance mfu_convention,
        # probes.profile.flops)
        ("seq_len", "batch", "status", "time_s", "peak_mem_bytes", "quadratic_share", "mfu"),
        # mfu_dense_6n: the old 6·N·tokens reading, shown beside for comparison
        (
            "time_std_s",
            "tokens_per_s",
            "linear_share",
            "fixed_share",
            "residual_s",
            "mfu_dense_6n",
        ),
    ),
    "profile_fit": TableSpec(
        "profile",
        "Scaling",
        ("a", "b", "c", "n_points", "method", "condition_number"),
        ("residual_rms_s", "max_rel_residual", "r_squared", "message"),
    ),
    "profile_padding_penalty": TableSpec(
        "profile",
        "Scaling",
        (
            "variant",
            "status",
            "padded_time_s",
            "unpadded_time_s",
            "measured_penalty",
            "predicted_penalty",
        ),
        # medians over n_batches drawn batches, with the spread; prediction: its basis or
        # "none: reason" (probes.profile.penalty.run_padding_penalty)
        (
            "measured_penalty_min",
            "measured_penalty_max",
            "n_batches",
            "n_batches_ok",
            "prediction",
            "batch",
            "longest",
            "n_real_tokens",
            "padding_waste",
        ),
    ),
    "profile_ce": TableSpec(
        "profile",
        "Cross-entropy",
        # variants: train_step | all_positions_unchunked | loss_positions_unchunked |
        # loss_positions_chunked (probes.profile.ce_timing.run_ce); source: the loss function timed
        ("variant", "status", "time_s", "step_share"),
        (
            "positions",
            "n_positions",
            "chunk_tokens",
            "peak_mem_bytes",
            "seq_len",
            "batch",
            "loss_tokens",
            "source",
        ),
    ),
    "profile_kernels": TableSpec(
        "profile",
        "Kernels",
        ("category", "device_type", "device_time_s", "share"),
        ("share_of_wall", "n_kernels", "n_calls"),
    ),
    # per strategy, in this column order (probes.replay.estimate): measured epoch time, saving vs
    # random with its 95% bootstrap interval, rank and tie group, the fit's prediction beside it
    "replay_estimates": TableSpec(
        "replay",
        "Summary",
        (
            "strategy",
            "valid",
            "invalid_reason",
            "micro_batches",
            "sampled",
            "estimated_time_s",
            "ci_low_s",
            "ci_high_s",
            "saving_vs_random",
            "saving_ci_low",
            "saving_ci_high",
            "rank",
            "tie_group",
            "optimizer_steps",
            "tokens_per_optimizer_step",
            "grad_accum",
            "grad_accum_for_same_tokens",
            "fit_predicted_saving",
            "fit_agrees",
            "fit_reason",
            "cpu_only",
        ),
        (
            "strata",
            "optimizer_step_s",
            "real_tokens",
            "computed_tokens",
            "gpu_busy_share",
            "host_bound_share",
            "fit_predicted_time_s",
            "max_seq_len",
            "note",
            # the model-assisted estimator (probes.replay.estimate.greg_estimate_all)
            "estimator",
            "saving_df",
            "model_time_s",
            "correction_s",
            "model_out_of_range_share",
            "stopped_by",
            "instrument_cv",
        ),
    ),
    # raw timings: sampled micro-batches, optimizer steps and fit points (kind), one row each;
    # the shape columns are the working model's (realize refits it: probes.realize.promise)
    "replay_steps": TableSpec(
        "replay",
        "Scaling",
        (
            "kind",
            "time_s",
            "status",
            "layout",
            "rows",
            "padded_length",
            "computed_tokens",
            "loss_tokens",
        ),
        ("strategy", "gpu_busy_share", "raw_times_s"),
    ),
    # every configuration's full plan as the replay timed it (CPU: the rehearsal's lengths), each
    # micro-batch's stratum: with replay_steps (plan_row, stratum) a saving can be recomputed
    "replay_plans": TableSpec(
        "replay",
        "Measured savings",
        (
            "strategy",
            "micro_batch_index",
            "optimizer_step_index",
            "layout",
            "rows",
            "padded_length",
            "computed_tokens",
            "real_tokens",
            "loss_tokens",
            "n_examples",
            "stratum",
            "paired",
        ),
        ("example_ids", "example_lengths", "example_loss_tokens", "documents_per_row"),
    ),
    # the scaling fit over the data's own lengths, with bootstrap intervals and its range
    "replay_fit": TableSpec(
        "replay",
        "Scaling",
        (
            "a",
            "b",
            "c",
            "a_ci_low",
            "a_ci_high",
            "b_ci_low",
            "b_ci_high",
            "c_ci_low",
            "c_ci_high",
            "range_low",
            "range_high",
            "n_points",
            "method",
        ),
        (
            "rows",
            "condition_number",
            "residual_rms_s",
            "max_rel_residual",
            "r_squared",
            "message",
            "resamples",
            "loss_share",
            "cpu_only",
            "max_seq_len",
            "lengths_source",
            "time_basis",
        ),
    ),
    # promised (the replay) vs realized (real training steps) per strategy checked, baseline first
    # (probes.realize.stage): epoch time and saving vs random with 95% intervals, the verdict and
    # each phase's share of the difference in percentage points
    "realize_realized": TableSpec(
        "realize",
        "Summary",
        (
            "strategy",
            "role",
            "optimizer_steps",
            "sampled_steps",
            "realized_time_s",
            "realized_ci_low_s",
            "realized_ci_high_s",
            "promised_time_s",
            "promised_ci_low_s",
            "promised_ci_high_s",
            "realized_saving",
            "realized_saving_ci_low",
            "realized_saving_ci_high",
            "promised_saving",
            "promised_saving_ci_low",
            "promised_saving_ci_high",
            "verdict",
            "differed",
            "cpu_only",
        ),
        (
            "realized_micro_batch_s",
            "realized_optimizer_s",
            "realized_rest_s",
            "promised_micro_batch_s",
            "promised_optimizer_s",
            "diff_micro_batch_pp",
            "diff_optimizer_pp",
            "diff_rest_pp",
            # the realized interval also holds the promised saving: too few steps to tell apart
            "promise_in_realized_interval",
            "estimator",
            "max_seq_len",
            "note",
        ),
    ),
    # one row per timed optimizer step: its wall time and phases (micro-batches, optimizer, rest)
    "realize_steps": TableSpec(
        "realize",
        "Summary",
        ("strategy", "optimizer_step_index", "time_s", "status"),
        (
            "run_order",
            "micro_batches",
            "computed_tokens",
            "micro_batch_s",
            "optimizer_s",
            "rest_s",
            "promised_micro_batch_s",  # the estimator's auxiliary (probes.realize.promise)
        ),
    ),
    # one row per sharding (ddp, fsdp2) x strategy x round x sampled optimizer step x rank
    # (probes.dp.worker): the real step split into compute / wait / collective, the optimizer
    # step, and single_s, the rank's micro-batches timed in one process without communication
    # (the prediction's input)
    "data_parallel_steps": TableSpec(
        "data_parallel",
        "Data parallel",
        (
            "sharding",
            "strategy",
            "round",
            "step",
            "rank",
            "step_s",
            "wait_s",
            "collective_s",
            "optimizer_s",
            "single_s",
        ),
        ("n_micro_batches", "padded_tokens", "real_tokens"),
    ),
    # one row per shape predicted (probes.memory.stage): the training shape, the p99 length, each
    # strategy's largest micro-batch; the peak split by category (probes.memory.tracker)
    "memory_shapes": TableSpec(
        "memory",
        "Memory",
        (
            "shape",
            "strategy",
            "rows",
            "length",
            "layout",
            "target_gib",
            "predicted_peak_gib",
            "headroom_gib",
            "verdict",
            "reason",
        ),
        (
            "loss_positions",
            "parameters_gib",
            "gradients_gib",
            "optimizer_state_gib",
            "activations_gib",
            "peak_phase",
            "peak_op",
            "seconds",
            "assumptions",
            "smallest_world_size",
            "fits_on_gpus",
        ),
    ),
    # one row per strategy (and `training`, the configured shape): its largest micro-batch
    "memory_changes": TableSpec(
        "memory",
        "Memory",
        (
            "strategy",
            "shape_rows",
            "shape_length",
            "predicted_peak_gib",
            "headroom_gib",
            "verdict",
            "reason",
        ),
        ("layout",),
    ),
    # each rank's predicted peak under FSDP2 per world size for the training shape
    # (probes.memory.sharded); the shapes table's training row carries the smallest that fits
    "memory_sharded": TableSpec(
        "memory",
        "Memory",
        (
            "shape",
            "strategy",
            "world_size",
            "reshard_after_forward",
            "rows",
            "length",
            "target_gib",
            "predicted_peak_gib",
            "headroom_gib",
            "verdict",
            "reason",
        ),
        (
            "parameters_gib",
            "gradients_gib",
            "optimizer_state_gib",
            "activations_gib",
            "communication_gib",
            "seconds",
            "assumptions",
        ),
    ),
    # the largest micro-batch that fits at max_seq_len and at the p99 length, equal tokens/update
    "memory_fit": TableSpec(
        "memory",
        "Memory",
        ("length_kind", "length", "max_micro_batch_size", "grad_accum", "predicted_peak_gib"),
        ("rows_per_update", "method"),
    ),
}


def table_columns(name: str) -> tuple[str, ...]:
    """Every column a table may carry, required first."""
    spec = TABLES[name]
    return spec.required + spec.optional


def check_table_columns(columns: Mapping | list | tuple, name: str, path: str | Path) -> None:
    """Raise ContractError naming the file and what is missing when a required column is absent."""
    missing = [c for c in TABLES[name].required if c not in set(columns)]
    if missing:
        spec = TABLES[name]
        raise ContractError(
            f"{path}: the {spec.section} table lacks column(s) {missing}; rerun the "
            f"`{spec.stage}` rule with this version of the workflow."
        )


class ContractError(ProbeError, ValueError):
    """A stage output that does not follow this contract; the message names file and columns."""
