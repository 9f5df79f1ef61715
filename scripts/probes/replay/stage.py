"""The replay stage: measured epoch time of every batching strategy, with intervals.

Order of work: positive control (synthetic harness, cheap, fails fast) -> idle-card check ->
load weights -> the user's harness -> scaling fit over the data's own lengths -> the stratified
replay of every strategy's plan -> outputs (written all-or-nothing).

On CPU (no GPU, profile.allow_cpu) the plans are rebuilt with every length capped at
``replay.cpu.max_seq_len`` and small samples, so the run stays within a few minutes; every output
says ``cpu_only`` and its numbers are not comparable with a GPU run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching import plans as pl
from probes.contracts import STAGE_OUTPUTS
from probes.errors import ControlFailedError, ProbeError
from probes.io import read_json, read_provenance, run_metadata
from probes.replay.combined import all_steps, time_combined, with_combined
from probes.replay.control import run_coverage_control, run_synthetic_control
from probes.replay.estimate import FitPricing, strategy_table
from probes.replay.sequential import build_design, run_sequential
from probes.replay.step_changes import StepChanges, add_step_changes
from probes.replay.timing import (
    OPTIMIZER_STEP,
    ReplayRunner,
    ReplaySettings,
    measure_fit,
    measure_instrument,
    median_row,
)
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step import fit as ft
from probes.step.idle import check_idle_card
from probes.step.load import load_step

LOG = logging.getLogger("probes.replay")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["replay"])
INPUT_KEYS = ("plans", "lengths", "recommendation", "gate")
CPU_NOTE = (
    "CPU-only run: lengths capped at {cap} tokens (max_seq_len {max_seq_len}) and small samples; "
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
    training: Mapping[str, Any],
    cpu_only: bool,
    cap: int,
) -> tuple[pd.DataFrame, int]:
    """The bucket stage's plans, or on CPU the same plans rebuilt with lengths capped at `cap`."""
    plans = pl.read_plans(inputs["plans"])
    max_seq_len = int(training["max_seq_len"])
    if not cpu_only or cap >= max_seq_len:
        return plans, max_seq_len
    seed = int(read_provenance(inputs["plans"]).get("plan_seed", 0))
    examples = pl.cap_examples(pl.read_examples(inputs["lengths"], max_seq_len), cap)
    capped = pl.build_plans(
        examples,
        micro_batch_size=int(training["micro_batch_size"]),
        grad_accum=int(training["grad_accum"]),
        max_seq_len=cap,
        bucket_size_batches=pl.recommended_bucket_size(read_json(inputs["recommendation"])),
        seed=seed,
    )
    return capped, cap


def settings_for(cfg: Mapping[str, Any], grad_accum: int, cpu_only: bool) -> ReplaySettings:
    section = cfg["cpu"] if cpu_only else cfg
    return ReplaySettings(
        n_strata=int(section["n_strata"]),
        samples_per_stratum=int(section["samples_per_stratum"]),
        bootstrap_resamples=int(cfg["bootstrap_resamples"]),
        grad_accum=grad_accum,
        seed=int(cfg["seed"]),
        warmup=int(section["warmup"]),
        busy_samples_per_stratum=int(cfg["busy_samples_per_stratum"]),
        host_bound_threshold=float(cfg["host_bound_threshold"]),
    )


def control_settings(cfg: Mapping[str, Any], grad_accum: int) -> ReplaySettings:
    control = cfg["control"]
    return ReplaySettings(
        n_strata=int(control["n_strata"]),
        samples_per_stratum=int(control["samples_per_stratum"]),
        bootstrap_resamples=int(cfg["bootstrap_resamples"]),
        grad_accum=grad_accum,
        seed=int(cfg["seed"]),
        warmup=0,
        busy_samples_per_stratum=0,
    )


def fit_lengths_for(
    plans: pd.DataFrame, cfg: Mapping[str, Any], max_seq_len: int, cpu_only: bool
) -> list[int]:
    """Configured lengths, else quantiles of the baseline's padded micro-batch lengths."""
    fit_cfg = cfg["fit"]
    configured = fit_cfg["cpu_lengths" if cpu_only else "lengths"]
    if configured:
        return sorted({min(int(v), max_seq_len) for v in configured})
    baseline = plans[plans["strategy"] == pl.BASELINE]["padded_length"].to_numpy()
    shortest = int(plans.loc[plans["layout"] == pl.PADDED, "padded_length"].min())
    return ft.default_fit_lengths(
        baseline,
        max_seq_len,
        int(fit_cfg["n_points"]),
        float(fit_cfg["low_quantile"]),
        shortest=shortest,
    )


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_replay(inputs, outputs, cfg.raw, Path(inputs["tokenizer"][0]).parent)
    LOG.info("replay summary: %s", summary)


@dataclass
class ReplayPlan:
    """What the stage knows before any timing: the device, the plans it replays (capped on
    CPU), the sampling settings and the scaling fit's lengths."""

    device: torch.device
    cpu_only: bool
    plans: pd.DataFrame
    max_len: int
    settings: ReplaySettings
    micro: int
    grad_accum: int
    fit_lengths: list[int]


def prepare(inputs: Mapping[str, Any], cfg: Mapping[str, Any]) -> ReplayPlan:
    from probes.step.runner import resolve_device

    missing = [k for k in INPUT_KEYS if k not in inputs]
    if missing:
        raise ReplayError(f"replay: missing path(s) for {missing}")
    replay_cfg, training, profile = cfg["replay"], cfg["training"], cfg["profile"]
    device = resolve_device(profile["device"], profile["allow_cpu"])
    cpu_only = device.type != "cuda"
    plans, max_len = plans_for_device(
        inputs, training, cpu_only, int(replay_cfg["cpu"]["max_seq_len"])
    )
    grad_accum = int(training["grad_accum"])
    plan = ReplayPlan(
        device=device,
        cpu_only=cpu_only,
        plans=plans,
        max_len=max_len,
        settings=settings_for(replay_cfg, grad_accum, cpu_only),
        micro=int(training["micro_batch_size"]),
        grad_accum=grad_accum,
        fit_lengths=fit_lengths_for(plans, replay_cfg, max_len, cpu_only),
    )
    LOG.info(
        "replay on %s%s: %d strategies, %d micro-batches; fit lengths %s",
        device,
        f" ({CPU_NOTE.format(cap=max_len, max_seq_len=training['max_seq_len'])})"
        if cpu_only
        else "",
        plans["strategy"].nunique(),
        len(plans),
        plan.fit_lengths,
    )
    return plan


def invalid_strategies(inputs: Mapping[str, Any]) -> dict[str, str]:
    """Strategies the mask gate rules out, with why (packing where documents would mix)."""
    reason = packing_validity(read_json(inputs["gate"]), str(inputs["gate"]))
    return {pl.PACKING: reason} if reason else {}


def load_replay_step(
    plan: ReplayPlan, cfg: Mapping[str, Any], inputs: Mapping[str, Any], model_path: str | Path
) -> tuple[ReplayRunner, StepChanges, tuple[torch.dtype, str], dict[str, Any]]:
    """The step (the user's trainer or harness) in the profiled dtype, its step-level changes
    added to the plans."""
    replay_cfg = cfg["replay"]
    if plan.cpu_only:
        torch.set_num_threads(int(replay_cfg["cpu"]["threads"]))
    torch.manual_seed(plan.settings.seed)
    dtype = replay_dtype(cfg["profile"]["dtype"], plan.device)
    step, vocab_size, pad_id, described = load_step(
        cfg, model_path, plan.device, dtype[0], plan.max_len if plan.cpu_only else None,
        plan.settings.seed,
    )  # fmt: skip
    runner = ReplayRunner(step, vocab_size, pad_id, plan.settings.seed, int(replay_cfg["repeats"]))
    changes = add_step_changes(
        runner, plan.plans, inputs, cfg["training"], replay_cfg, plan.cpu_only, plan.max_len
    )
    if changes:
        plan.plans = pd.concat([plan.plans, changes.plans], ignore_index=True)
    return runner, changes, dtype, described


def measure_model(
    runner: ReplayRunner, plan: ReplayPlan, cfg: Mapping[str, Any]
) -> tuple[Any, pd.DataFrame, float, dict[str, Any]]:
    """The scaling fit over the data's own lengths and the instrument's own spread on random's
    median micro-batch (the model is warm from the fit): (fit, its points, loss share,
    instrument)."""
    replay_cfg, settings = cfg["replay"], plan.settings
    random_plan = plan.plans[plan.plans["strategy"] == pl.BASELINE]
    loss_share = float(random_plan["loss_tokens"].sum()) / float(random_plan["real_tokens"].sum())
    if cfg["training"].get("loss_on") == "all":
        loss_share = 1.0
    fit_repeats = int(
        replay_cfg["cpu"]["fit_repeats"] if plan.cpu_only else replay_cfg["fit"]["repeats"]
    )
    fit, fit_points = measure_fit(
        runner, plan.fit_lengths, plan.micro, loss_share, fit_repeats, settings.seed,
        settings.bootstrap_resamples,
    )  # fmt: skip
    LOG.info("fit %s: a=%.3g b=%.3g c=%.3g", fit.fit.method, fit.fit.a, fit.fit.b, fit.fit.c)
    instrument = measure_instrument(
        runner,
        median_row(plan.plans, pl.BASELINE),
        int(replay_cfg["instrument_repeats"]),
        max(settings.warmup, 1),
    )
    LOG.info("instrument CV %.3f over %d identical micro-batches", instrument["cv"],
             instrument["repeats"])  # fmt: skip
    return fit, fit_points, loss_share, instrument


def time_plans(
    runner: ReplayRunner,
    plan: ReplayPlan,
    replay_cfg: Mapping[str, Any],
    invalid: Mapping[str, str],
    cv: tuple[float, float],
    progress: bool,
) -> tuple[Any, Any]:
    """The sequential design over every valid strategy within the budget: (design, result)."""
    settings = plan.settings
    section = replay_cfg["cpu"] if plan.cpu_only else replay_cfg
    design = build_design(plan.plans, settings.n_strata, settings.seed)
    valid = [name for name in design.strategies if name not in invalid]
    sequential = run_sequential(
        runner, design, settings, valid, cv[0], cv[1], float(section["budget_s"]), 0,
        int(section["round_size"]), progress=progress,
        per_strategy=settings.n_strata * settings.samples_per_stratum,
    )  # fmt: skip
    LOG.info(
        "replayed %d micro-batches in %d round(s), stopped by %s",
        len(sequential.steps),
        sequential.record["rounds"],
        sequential.record["stopped_by"],
    )
    return design, sequential


def price(
    plan: ReplayPlan,
    sequential: Any,
    invalid: Mapping[str, str],
    fit: Any,
    cv: float,
    changes: StepChanges,
    max_seq_len: int,
) -> pd.DataFrame:
    """Each strategy's estimate with its interval, its notes (step-level change, CPU cap)."""
    table = strategy_table(
        plan.plans, sequential.steps, sequential.optimizer_times, plan.settings, invalid,
        FitPricing(fit.fit, plan.micro, fit.low, fit.high), plan.cpu_only, plan.max_len,
        greg=sequential.estimates, stopped_by=sequential.record["stopped_by"], instrument_cv=cv,
    )  # fmt: skip
    titles = {c.strategy: f"step-level change: {c.title}" for c in changes.changes}
    notes = [
        f"{titles[s]}; {n}" if s in titles and n else titles.get(s, n)
        for s, n in zip(table["strategy"], table["note"], strict=True)
    ]
    if plan.cpu_only:
        cpu = CPU_NOTE.format(cap=plan.max_len, max_seq_len=max_seq_len)
        notes = [f"{cpu}; {n}" if n else cpu for n in notes]
    table["note"] = notes
    return table


def replay_provenance(
    cfg: Mapping[str, Any],
    plan: ReplayPlan,
    dtype: tuple[torch.dtype, str],
    described: dict[str, Any],
    changes: StepChanges,
    idle: Any,
    started: float,
) -> dict[str, Any]:
    from probes.profile.evidence import device_description

    return {
        **run_metadata(dict(cfg)),
        "device": device_description(plan.device),
        "cpu_only": plan.cpu_only,
        "dtype": str(dtype[0]).replace("torch.", ""),
        "dtype_reason": dtype[1],
        "max_seq_len_replayed": plan.max_len,
        "harness": described,
        "step_changes": [
            {"strategy": c.strategy, "title": c.title, "settings": c.settings}
            for c in changes.changes
        ],
        "not_measured": dict(changes.not_measured),  # name: why (probes.replay.step_changes)
        "idle_check": idle,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "wall_s": time.perf_counter() - started,
    }


SUMMARY_COLUMNS = (
    "strategy",
    "estimated_time_s",
    "ci_low_s",
    "ci_high_s",
    "saving_vs_random",
    "saving_ci_low",
    "saving_ci_high",
    "rank",
    "valid",
)


def run_replay(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str | Path],
    cfg: Mapping[str, Any],
    model_path: str | Path,
    card_probe: Callable[[int], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the stage and write every output, or none. `cfg` is the whole (default-filled)
    workflow config: sections replay, training, profile and trainer are read."""
    missing = [k for k in OUTPUT_KEYS if k not in outputs]
    if missing:
        raise ReplayError(f"replay: missing path(s) for {missing}")
    started = time.perf_counter()
    replay_cfg = cfg["replay"]
    plan = prepare(inputs, cfg)
    # the positive control first: cheap, and a broken estimator must not cost a GPU run
    control = synthetic_control_first(
        plan.plans, replay_cfg, plan.grad_accum, plan.fit_lengths, plan.micro
    )
    invalid = invalid_strategies(inputs)
    idle = check_idle_card(cfg["profile"], plan.device, card_probe, sleep)
    runner, changes, dtype, described = load_replay_step(plan, cfg, inputs, model_path)
    invalid = {**invalid, **changes.invalid}  # padding-free where documents would mix
    fit, fit_points, loss_share, instrument = measure_model(runner, plan, cfg)
    cv = instrument["cv"] if math.isfinite(instrument["cv"]) else 0.0
    cv_df = max(instrument["repeats"] - 1.0, 1.0)
    design, sequential = time_plans(runner, plan, replay_cfg, invalid, (cv, cv_df), progress)
    table = price(plan, sequential, invalid, fit, cv, changes, cfg["training"]["max_seq_len"])
    pricing = FitPricing(fit.fit, plan.micro, fit.low, fit.high)
    combined = time_combined(
        runner, plan, table, changes.changes, inputs, cfg, pricing, (cv, cv_df), progress
    )
    table = with_combined(table, combined)
    # the coverage control: the same design and estimator on simulated timings of known cost
    coverage = coverage_control(
        design, sequential, cv, len(sequential.optimizer_times), replay_cfg, plan.settings.seed
    )
    control.update(
        coverage=coverage, instrument=instrument, stopping=sequential.record,
        combined=combined.record,
    )  # fmt: skip
    control["checks"] = control_checks(control, coverage)
    control["observed"]["cpu_only"] = plan.cpu_only
    # the report shows and applies the threshold the replay used (its one home: the config)
    control["host_bound_threshold"] = float(replay_cfg["host_bound_threshold"])
    provenance = replay_provenance(cfg, plan, dtype, described, changes, idle, started)
    fit_row = fit_table_row(fit, plan.micro, loss_share, plan.cpu_only, plan.max_len, replay_cfg)
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("estimates", table, provenance)
        out.parquet(
            "steps",
            steps_table(
                all_steps(sequential.steps, combined),
                sequential.optimizer_times, fit_points,
            ),
            provenance,
        )  # fmt: skip
        out.parquet("fit", pd.DataFrame([fit_row]), provenance)
        out.json("control", control)
    return {
        "cpu_only": plan.cpu_only,
        "wall_s": provenance["wall_s"],
        "load_average": provenance["load_average"],
        "control_passed": control["passed"],
        "strategies": table[list(SUMMARY_COLUMNS)].to_dict("records"),
    }


def control_checks(control: dict[str, Any], coverage: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's Controls table lists each check on its own row: the busy-wait harness of
    known cost, and the intervals' coverage control."""
    errors = [v["time_ratio_rel_error"] for v in control["observed"]["strategies"].values()]
    return [
        {
            "name": control["name"],
            "expected": {
                "time_ratio_rel_error_max": control["expected"]["time_ratio_rel_error_max"]
            },
            "observed": {"time_ratio_rel_error_max": max(errors) if errors else None},
            "passed": bool(control["passed"]),
        },
        {
            "name": coverage["name"],
            "expected": {"coverage_min": coverage["expected"]["coverage_min"]},
            "observed": {"coverage_min": coverage["observed"]["min_coverage"]},
            "passed": bool(coverage["passed"]),
        },
    ]


def steps_table(
    steps: pd.DataFrame, optimizer_times: np.ndarray, fit_points: pd.DataFrame
) -> pd.DataFrame:
    """replay_steps.parquet: the timed micro-batches, the optimizer steps and the fit's points,
    list columns as plain lists (Parquet)."""
    optimizer_rows = pd.DataFrame(
        {"kind": OPTIMIZER_STEP, "time_s": optimizer_times, "status": "OK"}
    )
    all_steps = pd.concat([steps, optimizer_rows, fit_points], ignore_index=True)
    for column in (
        "example_ids", "example_lengths", "example_loss_tokens", "documents_per_row", "times_s",
    ):  # fmt: skip
        all_steps[column] = all_steps[column].map(
            lambda v: list(v) if isinstance(v, (list, np.ndarray)) else []
        )
    return all_steps


def fit_table_row(
    fit: Any, micro: int, loss_share: float, cpu_only: bool, max_len: int, replay_cfg: Mapping
) -> dict[str, Any]:
    """replay_fit.parquet's one row: the fit with its intervals, and what it was measured on."""
    fit_row = fit.as_row()
    fit_row.update(
        rows=micro,
        loss_share=loss_share,
        cpu_only=cpu_only,
        max_seq_len=max_len,
        lengths_source=(
            "configured"
            if replay_cfg["fit"]["cpu_lengths" if cpu_only else "lengths"]
            else f"quantiles {replay_cfg['fit']['low_quantile']}..1 of random's padded micro-batch "
            f"length, up to max_seq_len {max_len}"
        ),
        time_basis="forward + backward of one micro-batch (optimizer step excluded)",
    )
    return fit_row


def synthetic_control_first(
    plans: pd.DataFrame,
    replay_cfg: Mapping[str, Any],
    grad_accum: int,
    fit_lengths: list[int],
    micro: int,
) -> dict[str, Any]:
    """The busy-wait harness of known cost through the whole estimator; raises when it fails."""
    control_cfg = replay_cfg["control"]
    control = run_synthetic_control(
        plans,
        control_settings(replay_cfg, grad_accum),
        fit_lengths,
        micro,
        fit_repeats=int(control_cfg["fit_repeats"]),
        saving_tolerance=float(control_cfg["saving_tolerance"]),
        fit_tolerance=float(control_cfg["fit_tolerance"]),
        repeats=int(control_cfg["repeats"]),
    )
    return passed_or_raise(
        control,
        f"control %s ({control['observed']['wall_s']:.1f} s)",
        f"positive control failed: {control['observed']}",
    )


def passed_or_raise(result: dict[str, Any], line: str, failure: str) -> dict[str, Any]:
    """Log a control's outcome (`line` with %s for passed/FAILED) and raise when it failed,
    before any output is written."""
    LOG.info(line, "passed" if result["passed"] else "FAILED")
    if not result["passed"]:
        raise ControlFailedError(f"replay: {failure}, no output written")
    return result


def coverage_control(
    design: Any,
    sequential: Any,
    cv: float,
    n_optimizer_steps: int,
    replay_cfg: Mapping[str, Any],
    seed: int,
) -> dict[str, Any]:
    """The same design and estimator on simulated timings of known cost at the measured CV;
    raises when fewer than `replay.coverage.threshold` of the 95% intervals cover."""
    coverage_cfg = replay_cfg["coverage"]
    coverage = run_coverage_control(
        design,
        sequential.takes,
        max(cv, float(coverage_cfg["min_cv"])),
        n_optimizer_steps,
        int(coverage_cfg["replications"]),
        seed + 3,
        float(coverage_cfg["threshold"]),
    )
    return passed_or_raise(
        coverage,
        f"coverage control %s: min coverage {coverage['observed']['min_coverage']:.3f}",
        f"coverage control failed (95% intervals cover the exact saving in fewer than "
        f"{coverage_cfg['threshold']} of simulated runs): {coverage['observed']['coverage']}",
    )
