"""The contract between stages: every output file, table column, status and strategy name.

One home per fact. Rules (`workflow/rules/common.smk`), entry scripts, the report and the tests
import these names instead of retyping them; adding a column or an output file is one edit here
plus the code that writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from probes.errors import ProbeError

RESULTS_DIR = "results"

# ---------------------------------------------------------------------------------------------
# Example statuses (one row per example in lengths.parquet, none ever dropped)
# ---------------------------------------------------------------------------------------------

OK, TRUNCATED, EMPTY, ERROR = "OK", "TRUNCATED", "EMPTY", "ERROR"
STATUSES = (OK, TRUNCATED, EMPTY, ERROR)
# The examples that train (TRUNCATED ones train on their first max_seq_len tokens).
TRAINING_STATUSES = (OK, TRUNCATED)
# Counted in their own buckets, never folded into a distribution.
SKIPPED_STATUSES = (EMPTY, ERROR)

# The source label of an example whose file gives none.
UNKNOWN_SOURCE = "none"

# ---------------------------------------------------------------------------------------------
# Batching strategies (one name per strategy in every stage, table and figure)
# ---------------------------------------------------------------------------------------------

RANDOM = "random"
LENGTH_GROUPED = "length_grouped"
# Every example sorted by length before batching (a bucket as large as the dataset).
GLOBAL_SORT = "global_sort"
PACKING = "packing"
# transformers' BatchRebalanceSampler (variable micro-batch size): a comparison row in the sweep.
BATCH_REBALANCE = "batch_rebalance"
PAD_TO_MAX_SEQ_LEN = "pad_to_max_seq_len"
# random batching without the examples that carry no loss token (the replay's candidates)
RANDOM_NO_IDLE = "random_no_idle"
# the padding stage's reference orders: the data as given, and one global length sort
DATASET_ORDER = "dataset_order"
SORTED = "sorted"

STRATEGY_ORDER = (RANDOM, LENGTH_GROUPED, GLOBAL_SORT, PACKING, BATCH_REBALANCE)

# ---------------------------------------------------------------------------------------------
# Output files per stage (relative to the results directory)
# ---------------------------------------------------------------------------------------------

STAGE_OUTPUTS: dict[str, dict[str, str]] = {
    "mask": {
        "layers": "mask/layers.parquet",
        "gate": "mask/gate.json",
        "control": "mask/control.json",
    },
    "padding": {
        "lengths": "padding/lengths.parquet",
        "summary": "padding/summary.parquet",
        "distribution": "padding/distribution.parquet",
        "ce_chunks": "padding/ce_chunks.parquet",
        "control": "padding/control.json",
    },
    "bucket": {
        "sweep": "bucket/sweep.parquet",
        "summary": "bucket/summary.parquet",
        "recommendation": "bucket/recommendation.json",
        "control": "bucket/control.json",
        # every strategy's micro-batches for one seed (probes.batching.plans), what the replay times
        "plans": "bucket/plans.parquet",
        # straggler cost per strategy x bucket size x seed at W = 1, 2, 4, 8 ranks
        # (probes.bucket.data_parallel)
        "data_parallel": "bucket/data_parallel.parquet",
    },
    "profile": {
        "scaling": "profile/scaling.parquet",
        "fit": "profile/fit.parquet",
        "padding_penalty": "profile/padding_penalty.parquet",
        "ce": "profile/ce.parquet",
        "kernels": "profile/kernels.parquet",
        "raw": "profile/profile-output.txt",
        "provenance": "profile/provenance.json",
        "control": "profile/control.json",
    },
    # measured epoch time per strategy (probes.replay.stage); same gpu resource as profile
    "replay": {
        "estimates": "profile/replay.parquet",
        "steps": "profile/replay_steps.parquet",
        "fit": "profile/replay_fit.parquet",
        "control": "profile/replay_control.json",
    },
    # real training steps of the baseline and the top changes (probes.realize.stage); gpu resource
    "realize": {
        "realized": "realize/realized.parquet",
        "steps": "realize/steps.parquet",
        "summary": "realize/summary.json",
        "control": "realize/control.json",
    },
    # real DDP steps under torchrun (probes.dp.stage); only with training.world_size > 1
    "data_parallel": {
        "steps": "data_parallel/steps.parquet",
        "summary": "data_parallel/summary.json",
    },
    # will it fit: the peak memory per shape on fake tensors (probes.memory.stage)
    "memory": {
        "shapes": "memory/shapes.parquet",
        "changes": "memory/changes.parquet",
        "fit": "memory/fit.parquet",
        "summary": "memory/summary.json",
        "control": "memory/control.json",
    },
    "report": {
        "markdown": "report/playbook-evidence.md",
        "figures": "report/figures",
        # every recommended change as settings for the installed libraries (probes.apply.document)
        "recommendations": "report/recommendations.json",
    },
}
# The probe stages in chain order; the report reads all of their outputs.
STAGES = ("mask", "padding", "bucket", "profile", "replay", "realize")
# Stages that run only under a config condition: stage -> (condition, the not-run reason). The
# report reads their outputs only when they ran (`optional_report_inputs`).
OPTIONAL_STAGES = {
    "data_parallel": ("training.world_size > 1", "world_size 1"),
    "memory": ("memory.enabled", "memory.enabled false"),
}


def stage_enabled(stage: str, config: Mapping) -> bool:
    """Whether an optional stage runs under `config` (a default-filled workflow config)."""
    if stage == "data_parallel":
        return int(config["training"].get("world_size", 1)) > 1
    if stage == "memory":  # a config without the (default-filled) section does not ask for it
        return bool(config.get("memory", {}).get("enabled", False))
    return True


# ---------------------------------------------------------------------------------------------
# Inputs: what each stage reads, declared once for its rule (common.smk `stage_inputs`) and its
# script (probes.stage.main). A value is an upstream output (stage, key) or one of the user's
# files, resolved from the config by probes.config.stage_inputs.
# ---------------------------------------------------------------------------------------------

MODEL_CONFIG = "model config.json"  # model.config_path, else config.json in model.path
MODEL_TOKENIZER = "model tokenizer"  # TOKENIZER_FILES in model.path
DATA_FILES = "data files"  # every data.files[].path
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STAGE_INPUTS: dict[str, dict[str, tuple[str, str] | str]] = {
    "mask": {"model_config": MODEL_CONFIG},
    "padding": {
        "gate": ("mask", "gate"),
        "model_config": MODEL_CONFIG,
        "tokenizer": MODEL_TOKENIZER,
        "data": DATA_FILES,
    },
    "bucket": {"lengths": ("padding", "lengths")},
    "profile": {
        "lengths": ("padding", "lengths"),
        "recommendation": ("bucket", "recommendation"),
        "model_config": MODEL_CONFIG,
        "tokenizer": MODEL_TOKENIZER,
    },
    "replay": {
        "plans": ("bucket", "plans"),
        "lengths": ("padding", "lengths"),
        "recommendation": ("bucket", "recommendation"),
        "gate": ("mask", "gate"),
        "model_config": MODEL_CONFIG,
        "tokenizer": MODEL_TOKENIZER,
    },
    "realize": {
        "estimates": ("replay", "estimates"),
        "units": ("replay", "steps"),  # the replay's timed units: the per-step promise
        "plans": ("bucket", "plans"),
        "lengths": ("padding", "lengths"),
        "recommendation": ("bucket", "recommendation"),
        "model_config": MODEL_CONFIG,
        "tokenizer": MODEL_TOKENIZER,
    },
    "data_parallel": {
        "plans": ("bucket", "plans"),
        "recommendation": ("bucket", "recommendation"),
        "model_config": MODEL_CONFIG,
        "tokenizer": MODEL_TOKENIZER,
    },
    # config.json and the plans only: no weights, no GPU
    "memory": {"model_config": MODEL_CONFIG, "plans": ("bucket", "plans")},
}


def stage_outputs(stage: str, results_dir: str | Path = RESULTS_DIR) -> dict[str, str]:
    """Output key -> path of one stage (what its rule declares and its `run` writes)."""
    return {key: str(Path(results_dir) / rel) for key, rel in STAGE_OUTPUTS[stage].items()}


def report_inputs(results_dir: str | Path = RESULTS_DIR) -> dict[str, str]:
    """`<stage>_<key>` -> path of every probe output (the report rule's inputs)."""
    return {
        f"{stage}_{key}": path
        for stage in STAGES
        for key, path in stage_outputs(stage, results_dir).items()
    }


def optional_report_inputs(
    config: Mapping, results_dir: str | Path = RESULTS_DIR
) -> dict[str, str]:
    """`<stage>_<key>` -> path of every optional stage's output that runs under `config`."""
    return {
        f"{stage}_{key}": path
        for stage in OPTIONAL_STAGES
        if stage_enabled(stage, config)
        for key, path in stage_outputs(stage, results_dir).items()
    }


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
        ("strategy", "gpu_busy_share"),
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
    # one row per strategy x round x sampled optimizer step x rank (probes.dp.worker): the real
    # DDP step split into compute / wait / collective, the optimizer step, and single_s, the
    # rank's micro-batches timed in one process without communication (the prediction's input)
    "data_parallel_steps": TableSpec(
        "data_parallel",
        "Data parallel",
        (
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
    # the largest micro-batch that fits at max_seq_len and at the p99 length, equal tokens/update
    "memory_fit": TableSpec(
        "memory",
        "Memory",
        ("length_kind", "length", "max_micro_batch_size", "grad_accum", "predicted_peak_gib"),
        ("rows_per_update", "method"),
    ),
}

CONTROL_KEYS = ("name", "description", "expected", "observed", "passed")
# JSON outputs and the keys the report reads (a not-run stage may carry only status + reason).
JSONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mask_gate": ("mask", ("passed", "confirm", "target")),
    "bucket_recommendation": ("bucket", ("status", "recommended", "thresholds")),
    # dtype/dtype_reason: probes.step.dtype; mfu_convention: probes.profile.flops.MFU_CONVENTION
    "profile_provenance": (
        "profile",
        ("device", "cpu_only", "harness", "dtype", "dtype_reason", "mfu_convention"),
    ),
    "mask_control": ("mask", CONTROL_KEYS),
    "padding_control": ("padding", CONTROL_KEYS),
    "bucket_control": ("bucket", CONTROL_KEYS),
    "profile_control": ("profile", CONTROL_KEYS),
    # the synthetic busy-wait harness: savings within 5%, a, b, c within 10%; plus "coverage"
    # (the intervals' coverage control), "instrument" (CV of repeated identical micro-batches)
    # and "stopping" (why the timing stopped)
    "replay_control": ("replay", CONTROL_KEYS),
    # what realize checked and its verdicts; {"status": "not_run", "reason": ...} when it did not
    "realize_summary": ("realize", ("status", "verdicts")),
    # the virtual-clock harness of known cost: epoch time and optimizer phase within 5%
    "realize_control": ("realize", CONTROL_KEYS),
    # per strategy real vs predicted, communication share, straggler wait; where each rank ran
    "data_parallel_summary": (
        "data_parallel",
        ("world_size", "backend", "strategies", "ranks", "tolerance"),
    ),
    "memory_summary": ("memory", ("target_gib", "target", "dtype", "gradient_checkpointing")),
    # a peak known by construction, real CPU steps within ±memory.tolerance, the check failing
    # a prediction without the optimizer state (probes.memory.control)
    "memory_control": ("memory", CONTROL_KEYS),
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
