from snakemake.utils import min_version, validate

from probes.config import check_config_paths, check_removed_options, stage_inputs
from probes.step.threads import available_cores
from probes.contracts import (
    optional_report_inputs,
    report_inputs,
    stage_enabled,
    stage_outputs,
)

min_version("8.20")

# A value no longer offered fails first, naming what replaces it.
check_removed_options(config)
# Fills defaults and rejects unknown keys and bad types before any job runs.
validate(config, schema="../schemas/config.schema.yaml")
# A user path that does not exist fails here, at parse time, naming its key.
check_config_paths(config)


def out(stage, key):
    """An output path of a stage, from the contract (probes.contracts.STAGE_OUTPUTS).

    Downstream inputs use it too, not `rules.X.output.Y`: a rule reference makes Snakemake run
    the upstream rule even under `--allowed-rules`, which users rely on to rerun one stage.
    """
    return stage_outputs(stage)[key]


def dp_ranks(config):
    """training.world_size: the data_parallel job's ranks (one core each on CPU)."""
    return int(config["training"]["world_size"])


def dp_gpus(config):
    """GPUs the data_parallel job asks for: one per rank, none when profile.device is cpu."""
    return 0 if config["profile"]["device"] == "cpu" else dp_ranks(config)


def cpu_threads(section):
    """A timing rule's threads: <section>.cpu.threads, null for every core (probes.step.threads);
    Snakemake caps it at --cores and runs nothing beside it."""
    configured = config[section]["cpu"]["threads"]
    return available_cores() if configured is None else int(configured)
