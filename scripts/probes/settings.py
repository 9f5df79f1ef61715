"""The validated workflow config as small frozen dataclasses, one per section.

Defaults are written once, in `workflow/schemas/config.schema.yaml`; these classes carry none. A
config reaches them already validated and default-filled (by Snakemake's `validate` or by
`probes.config.load_config`), and `WorkflowConfig.from_dict` fails if a section's keys and the
class's fields ever drift apart. Stages take their typed section (`cfg.bucket.seeds`); the raw
dict rides along for the provenance hash.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    path: str
    config_path: str | None
    chat_template: str | None


@dataclass(frozen=True)
class DataFile:
    path: str
    source: str | None
    source_column: str


@dataclass(frozen=True)
class DataConfig:
    files: tuple[DataFile, ...]


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    grad_accum: int
    max_seq_len: int
    loss_on: str
    world_size: int


@dataclass(frozen=True)
class TrainerConfig:
    factory: str | None
    command: str | tuple[str, ...] | None  # a string or a list, as given (probes.step.command)
    command_inputs: tuple[str, ...]
    command_timeout_s: float


@dataclass(frozen=True)
class MaskConfig:
    target_compute_capability: str | float
    dtype: str
    torch_version: str | None
    cudnn_version: int | None
    prefer_cudnn: bool | None
    scenarios: tuple[str, ...]
    pad_fraction: float
    packed_doc_fractions: tuple[float, ...]
    expected_sliding_window: int | None
    confirm_on_cuda: bool
    fail_on_violation: bool
    max_mask_gib: float


@dataclass(frozen=True)
class PaddingConfig:
    ce_memory_budget_gib: float
    waste_seeds: int
    histogram_bins: int
    histogram_max_sources: int
    tokenize_batch_size: int
    reference_check_examples: int
    min_loss_fraction: float
    allow_no_loss: bool


@dataclass(frozen=True)
class BucketConfig:
    seeds: tuple[int, ...]
    bucket_sizes: tuple[int, ...] | None
    gain_share: float
    min_diversity_share: float
    gain_metric: str
    diversity_level: str
    packing: tuple[str, ...]


@dataclass(frozen=True)
class CudaProfileConfig:
    lengths: tuple[int, ...]
    warmup: int
    repeats: int
    kernel_steps: int
    padding_batches: int
    probe_length: int | None


@dataclass(frozen=True)
class CpuProfileConfig:
    lengths: tuple[int, ...]
    warmup: int
    repeats: int
    kernel_steps: int
    padding_batches: int
    threads: int | None
    probe_length: int | None


@dataclass(frozen=True)
class IdleConfig:
    timeout_s: float
    initial_backoff_s: float
    max_backoff_s: float
    max_memory_used_mib: float
    max_utilization_pct: float
    allow_other_processes: bool


@dataclass(frozen=True)
class ProfileConfig:
    harness: str
    harness_options: Mapping[str, Any]
    device: str
    allow_cpu: bool
    dtype: str
    attn_implementation: str
    micro_batch_size: int | None
    loss_fraction: float | None
    ce_chunk_tokens: int
    peak_tflops: float | None
    seed: int
    padding_draws: int
    padding_waste_quantile: float
    double_count_tolerance: float
    cuda: CudaProfileConfig
    cpu: CpuProfileConfig
    idle: IdleConfig


@dataclass(frozen=True)
class ReplayFitConfig:
    n_points: int
    low_quantile: float
    repeats: int
    lengths: tuple[int, ...] | None
    cpu_lengths: tuple[int, ...] | None


@dataclass(frozen=True)
class ReplayCpuConfig:
    max_seq_len: int
    n_strata: int
    samples_per_stratum: int
    warmup: int
    budget_s: float
    round_size: int
    fit_repeats: int
    threads: int | None
    combined_budget_s: float


@dataclass(frozen=True)
class ReplayControlConfig:
    n_strata: int
    samples_per_stratum: int
    repeats: int
    fit_repeats: int
    saving_tolerance: float
    fit_tolerance: float


@dataclass(frozen=True)
class ReplayCoverageConfig:
    replications: int
    threshold: float
    min_cv: float


@dataclass(frozen=True)
class ReplayConfig:
    step_changes: bool
    compile: bool  # price torch_compile (probes.step.compile)
    combined: bool
    combined_budget_s: float
    seed: int
    n_strata: int
    samples_per_stratum: int
    repeats: int
    warmup: int
    bootstrap_resamples: int
    busy_samples_per_stratum: int
    host_bound_threshold: float
    budget_s: float
    round_size: int
    instrument_repeats: int
    reference_every: int
    plan_to_budget: bool
    decide_within: float
    max_width: float
    coverage: ReplayCoverageConfig
    fit: ReplayFitConfig
    cpu: ReplayCpuConfig
    control: ReplayControlConfig


@dataclass(frozen=True)
class RealizeConfig:
    enabled: bool
    max_changes: int
    cpu_max_changes: int
    sample_steps: int
    cpu_sample_steps: int
    cpu_budget_s: float
    warmup: int
    seed: int
    control_steps: int
    control_tolerance: float
    agree_within: float


@dataclass(frozen=True)
class DataParallelCpuConfig:
    max_seq_len: int
    threads_per_rank: int


@dataclass(frozen=True)
class DataParallelConfig:
    backend: str
    sharding: tuple[str, ...]
    steps: int
    rounds: int
    warmup_rounds: int
    tolerance: float
    timeout_s: float
    seed: int
    cpu: DataParallelCpuConfig


@dataclass(frozen=True)
class MemoryConfig:
    enabled: bool
    target_gib: float
    target_name: str
    allocator_round_bytes: int
    length_quantile: float
    tolerance: float
    scale_layers: bool
    world_sizes: tuple[int, ...]
    reshard_after_forward: tuple[bool, ...]
    every_world_size: bool


@dataclass(frozen=True)
class ReportConfig:
    histogram_top_sources: int
    max_recommendations: int
    figure_dpi: int


@dataclass(frozen=True)
class WorkflowConfig:
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    trainer: TrainerConfig
    mask: MaskConfig
    padding: PaddingConfig
    bucket: BucketConfig
    profile: ProfileConfig
    replay: ReplayConfig
    realize: RealizeConfig
    data_parallel: DataParallelConfig
    report: ReportConfig
    memory: MemoryConfig
    # The validated, default-filled dict: what the provenance hashes (not compared, not typed).
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> WorkflowConfig:
        """Build from a validated, default-filled config (see probes.config.load_config)."""
        from probes.config import fill_defaults, schema

        filled = fill_defaults(_plain({k: v for k, v in config.items() if k != "raw"}), schema())
        return dataclasses.replace(_build(cls, filled, "config"), raw=filled)


def as_dict(section: Any) -> dict[str, Any]:
    """A section as a plain dict (for code that still takes mappings, and for JSON)."""
    return _plain(dataclasses.asdict(section))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _build(cls: type, mapping: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name != "raw"]
    names = {f.name for f in fields}
    extra, missing = sorted(set(mapping) - names), sorted(names - set(mapping))
    if extra or missing:
        # the schema and this module disagree: a programming error, named precisely
        raise KeyError(
            f"{where}: keys {extra} are not fields of {cls.__name__} and fields {missing} have "
            "no value; keep probes/settings.py and workflow/schemas/config.schema.yaml in step."
        )
    return cls(
        **{f.name: _convert(hints[f.name], mapping[f.name], f"{where}.{f.name}") for f in fields}
    )


def _convert(hint: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint, origin = options[0], typing.get_origin(options[0])
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is not None and issubclass(origin, Mapping):
        return types.MappingProxyType(dict(value))
    return value
