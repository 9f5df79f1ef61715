"""What each stage reads and writes: output files (relative to the results directory) and inputs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

RESULTS_DIR = "results"

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
        # every configuration's full plan as timed (a CPU rehearsal's lengths), with its strata
        "plans": "profile/replay_plans.parquet",
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
        "sharded": "memory/sharded.parquet",
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
    # config.json, the plans and the lengths (a changed micro-batch size's own plan): no
    # weights, no GPU
    "memory": {
        "model_config": MODEL_CONFIG,
        "plans": ("bucket", "plans"),
        "lengths": ("padding", "lengths"),
    },
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
