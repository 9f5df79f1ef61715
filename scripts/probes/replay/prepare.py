"""The replay's preparation, before any timing: the device and dtype, the bucket stage's plans
(rebuilt at a CPU rehearsal's scaled lengths), the settings (the one reading of ``cfg.replay``,
resolved for the device: ``ReplaySettings`` for sampling and timing, ``StageSettings`` for the
rest), the scaling fit's lengths, and the strategies the mask gate rules out (``prepare`` ->
``ReplayPlan``; ``invalid_strategies``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from probes.batching import plans as pl
from probes.errors import ProbeError
from probes.io import read_json, read_provenance
from probes.replay.timing import ReplaySettings
from probes.settings import (
    ReplayConfig,
    ReplayControlConfig,
    ReplayCoverageConfig,
    TrainingConfig,
    WorkflowConfig,
)
from probes.step import fit as ft

LOG = logging.getLogger("probes.replay")

INPUT_KEYS = ("plans", "lengths", "recommendation", "gate")
CPU_NOTE = (
    "CPU-only run: a rehearsal of the data's shape, every length scaled by {cap}/{max_seq_len} "
    "(the same micro-batches, padding waste and packing as the real run, at a CPU's lengths); "
    "not comparable with a GPU run"
)


class ReplayError(ProbeError, RuntimeError):
    """The stage cannot run as configured, or its control failed; nothing was written."""


def packing_validity(gate: Mapping[str, Any], origin: str = "gate.json") -> str | None:
    """None when the mask gate's packed scenario ran without a violation, else why packing is
    invalid (cross-document attention, or not checked at all: then it is never recommended)."""
    scenarios = {s.get("scenario"): s for s in gate.get("scenarios", []) if isinstance(s, dict)}
    packed = scenarios.get("packed")
    if packed is None:
        return (
            f"{origin}: the mask gate did not run its packed scenario, so cross-document attention "
            "is unchecked; add 'packed' to mask.scenarios"
        )
    violations = int(packed.get("violations", 0) or 0)
    if violations:
        return (
            f"{origin}: the mask gate's packed scenario has {violations} violation(s): documents "
            "attend to each other, so packing changes what the model learns"
        )
    return None


def replay_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the profile stage would pick (probes.step.dtype): bf16 on CUDA; on CPU bf16
    only where it is computed natively, else float32. Returns the dtype and why."""
    from probes.step.dtype import resolve_dtype

    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    name, reason = resolve_dtype(requested, device.type)
    return names[name], reason


def plans_for_device(
    inputs: Mapping[str, str | Path],
    training: TrainingConfig,
    cpu_only: bool,
    cap: int,
) -> tuple[pd.DataFrame, int]:
    """The bucket stage's plans, or on CPU the same plans rebuilt at a rehearsal's lengths
    (every length scaled by cap / max_seq_len: plans.rehearsal_length)."""
    plans = pl.read_plans(inputs["plans"])
    max_seq_len = int(training.max_seq_len)
    if not cpu_only or cap >= max_seq_len:
        return plans, max_seq_len
    seed = int(read_provenance(inputs["plans"]).get("plan_seed", 0))
    examples = pl.rehearsal_examples(
        pl.read_examples(inputs["lengths"], max_seq_len), cap, max_seq_len
    )
    capped = pl.build_plans(
        examples,
        micro_batch_size=int(training.micro_batch_size),
        grad_accum=int(training.grad_accum),
        max_seq_len=cap,
        bucket_size_batches=pl.recommended_bucket_size(read_json(inputs["recommendation"])),
        seed=seed,
    )
    return capped, cap


def settings_for(cfg: ReplayConfig, grad_accum: int, cpu_only: bool) -> ReplaySettings:
    section = cfg.cpu if cpu_only else cfg
    return ReplaySettings(
        n_strata=int(section.n_strata),
        samples_per_stratum=int(section.samples_per_stratum),
        bootstrap_resamples=int(cfg.bootstrap_resamples),
        grad_accum=grad_accum,
        seed=int(cfg.seed),
        warmup=int(section.warmup),
        busy_samples_per_stratum=int(cfg.busy_samples_per_stratum),
        host_bound_threshold=float(cfg.host_bound_threshold),
        decide_within=float(cfg.decide_within),
        max_width=float(cfg.max_width),
    )


def control_settings(cfg: ReplayConfig, grad_accum: int) -> ReplaySettings:
    control = cfg.control
    return ReplaySettings(
        n_strata=int(control.n_strata),
        samples_per_stratum=int(control.samples_per_stratum),
        bootstrap_resamples=int(cfg.bootstrap_resamples),
        grad_accum=grad_accum,
        seed=int(cfg.seed),
        warmup=0,
        busy_samples_per_stratum=0,
    )


def fit_lengths_for(
    plans: pd.DataFrame, cfg: ReplayConfig, max_seq_len: int, cpu_only: bool
) -> list[int]:
    """Configured lengths, else quantiles of the baseline's padded micro-batch lengths."""
    fit_cfg = cfg.fit
    configured = fit_cfg.cpu_lengths if cpu_only else fit_cfg.lengths
    if configured:
        return sorted({min(int(v), max_seq_len) for v in configured})
    baseline = plans[plans["strategy"] == pl.BASELINE]["padded_length"].to_numpy()
    shortest = int(plans.loc[plans["layout"] == pl.PADDED, "padded_length"].min())
    return ft.default_fit_lengths(
        baseline,
        max_seq_len,
        int(fit_cfg.n_points),
        float(fit_cfg.low_quantile),
        shortest=shortest,
    )


def fit_lengths_source(cfg: ReplayConfig, max_seq_len: int, cpu_only: bool) -> str:
    """Where the scaling fit's lengths came from (replay_fit.parquet says it)."""
    fit_cfg = cfg.fit
    if fit_cfg.cpu_lengths if cpu_only else fit_cfg.lengths:
        return "configured"
    return (
        f"quantiles {fit_cfg.low_quantile}..1 of random's padded micro-batch length, up to "
        f"max_seq_len {max_seq_len}"
    )


@dataclass(frozen=True)
class StageSettings:
    """The replay's keys beyond sampling and timing (ReplaySettings), read once and resolved
    for the device (``replay.cpu.*`` on CPU): every part of the stage reads these, none the
    config."""

    budget_s: float
    budget_key: str  # the key that buys more timing on this device (the power line names it)
    combined: bool
    combined_budget_s: float  # 0 where combined is false
    round_size: int
    plan_to_budget: bool
    repeats: int
    threads: int | None  # timing threads on CPU (None: the machine's)
    fit_repeats: int
    fit_lengths_source: str
    instrument_repeats: int
    reference_every: int
    step_changes: bool
    compile: bool
    coverage: ReplayCoverageConfig
    control: ReplayControlConfig
    control_sampling: ReplaySettings


def stage_settings(
    cfg: ReplayConfig, grad_accum: int, max_seq_len: int, cpu_only: bool
) -> StageSettings:
    section = cfg.cpu if cpu_only else cfg
    return StageSettings(
        budget_s=float(section.budget_s),
        budget_key="replay.cpu.budget_s" if cpu_only else "replay.budget_s",
        combined=bool(cfg.combined),
        combined_budget_s=float(section.combined_budget_s) if cfg.combined else 0.0,
        round_size=int(section.round_size),
        plan_to_budget=bool(cfg.plan_to_budget),
        repeats=int(cfg.repeats),
        threads=cfg.cpu.threads if cpu_only else None,
        fit_repeats=int(cfg.cpu.fit_repeats if cpu_only else cfg.fit.repeats),
        fit_lengths_source=fit_lengths_source(cfg, max_seq_len, cpu_only),
        instrument_repeats=int(cfg.instrument_repeats),
        reference_every=int(cfg.reference_every),
        step_changes=bool(cfg.step_changes),
        compile=bool(cfg.compile),
        coverage=cfg.coverage,
        control=cfg.control,
        control_sampling=control_settings(cfg, grad_accum),
    )


@dataclass
class ReplayPlan:
    """What the stage knows before any timing: the device, the plans it replays (rehearsed
    on CPU), the sampling settings and the scaling fit's lengths."""

    device: torch.device
    cpu_only: bool
    plans: pd.DataFrame
    max_len: int
    settings: ReplaySettings
    micro: int
    grad_accum: int
    fit_lengths: list[int]
    stage: StageSettings


def prepare(inputs: Mapping[str, Any], cfg: WorkflowConfig) -> ReplayPlan:
    from probes.step.runner import resolve_device

    missing = [k for k in INPUT_KEYS if k not in inputs]
    if missing:
        raise ReplayError(f"replay: missing path(s) for {missing}")
    replay_cfg, training, profile = cfg.replay, cfg.training, cfg.profile
    device = resolve_device(profile.device, profile.allow_cpu)
    cpu_only = device.type != "cuda"
    plans, max_len = plans_for_device(inputs, training, cpu_only, int(replay_cfg.cpu.max_seq_len))
    grad_accum = int(training.grad_accum)
    plan = ReplayPlan(
        device=device,
        cpu_only=cpu_only,
        plans=plans,
        max_len=max_len,
        settings=settings_for(replay_cfg, grad_accum, cpu_only),
        micro=int(training.micro_batch_size),
        grad_accum=grad_accum,
        fit_lengths=fit_lengths_for(plans, replay_cfg, max_len, cpu_only),
        stage=stage_settings(replay_cfg, grad_accum, max_len, cpu_only),
    )
    LOG.info(
        "replay on %s%s: %d strategies, %d micro-batches; fit lengths %s",
        device,
        f" ({CPU_NOTE.format(cap=max_len, max_seq_len=training.max_seq_len)})" if cpu_only else "",
        plans["strategy"].nunique(),
        len(plans),
        plan.fit_lengths,
    )
    return plan


def invalid_strategies(inputs: Mapping[str, Any]) -> dict[str, str]:
    """Strategies the mask gate rules out, with why (packing where documents would mix)."""
    reason = packing_validity(read_json(inputs["gate"]), str(inputs["gate"]))
    return {pl.PACKING: reason} if reason else {}
