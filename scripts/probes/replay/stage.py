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
from probes.replay.control import run_coverage_control, run_synthetic_control
from probes.replay.estimate import FitPricing, strategy_table
from probes.replay.sequential import build_design, run_sequential
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


@dataclass(frozen=True)
class StepChanges:
    """The step-level changes the replay prices (probes.step.changes), their plan rows, and
    what this device cannot measure."""

    changes: list[Any]
    plans: pd.DataFrame
    not_measured: list[str]

    def __bool__(self) -> bool:
        return bool(self.changes)


def add_step_changes(
    runner: ReplayRunner,
    plans: pd.DataFrame,
    inputs: Mapping[str, Any],
    training: Mapping[str, Any],
    replay_cfg: Mapping[str, Any],
    cpu_only: bool,
    max_len: int,
) -> StepChanges:
    """The step-level changes to price against the loaded step (set on `runner`), their plan
    rows beside `plans` (the device's plans), and what this device cannot measure."""
    from probes.step import changes as sc

    switch = sc.StepSwitch(runner.runner)
    runner.switch = switch
    if not replay_cfg.get("step_changes", True):
        return StepChanges([], pd.DataFrame(), [])
    changes = step_changes_for(switch.base, training)
    switch.configs = {c.strategy: c.config for c in changes}
    added = change_plans_for(changes, plans, inputs, training, cpu_only, max_len)
    LOG.info("step-level changes: %s (base %s)", [c.strategy for c in changes], switch.base)
    return StepChanges(changes, added, sc.gpu_only("cpu" if cpu_only else "cuda"))


def step_changes_for(base: Any, training: Mapping[str, Any]) -> list[Any]:
    from probes.step import changes as sc

    return sc.step_changes(base, int(training["micro_batch_size"]), int(training["grad_accum"]))


def change_plans_for(
    changes: list[Any],
    plans: pd.DataFrame,
    inputs: Mapping[str, Any],
    training: Mapping[str, Any],
    cpu_only: bool,
    max_len: int,
) -> pd.DataFrame:
    """The plan rows of the step-level changes: the baseline's micro-batches, or the trainer's
    random order at a changed micro-batch size (the lengths capped as the device's plans are)."""
    from probes.step import changes as sc

    examples = pl.read_examples(inputs["lengths"], int(training["max_seq_len"]))
    if cpu_only:
        examples = pl.cap_examples(examples, max_len)
    seed = int(read_provenance(inputs["plans"]).get("plan_seed", 0))
    micro = sc.micro_batch_plans(changes, examples, max_len, seed)
    return sc.change_plans(plans, changes, micro)


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
    workflow config: sections replay, training and profile are read."""
    from probes.profile.evidence import device_description
    from probes.step.runner import resolve_device

    missing = [k for k in OUTPUT_KEYS if k not in outputs] + [
        k for k in INPUT_KEYS if k not in inputs
    ]
    if missing:
        raise ReplayError(f"replay: missing path(s) for {missing}")
    replay_cfg, training, profile = cfg["replay"], cfg["training"], cfg["profile"]
    started = time.perf_counter()
    device = resolve_device(profile["device"], profile["allow_cpu"])
    cpu_only = device.type != "cuda"
    cap = int(replay_cfg["cpu"]["max_seq_len"])
    plans, max_len = plans_for_device(inputs, training, cpu_only, cap)
    grad_accum = int(training["grad_accum"])
    micro = int(training["micro_batch_size"])
    settings = settings_for(replay_cfg, grad_accum, cpu_only)
    fit_lengths = fit_lengths_for(plans, replay_cfg, max_len, cpu_only)
    fit_repeats = int(
        replay_cfg["cpu"]["fit_repeats"] if cpu_only else replay_cfg["fit"]["repeats"]
    )
    LOG.info(
        "replay on %s%s: %d strategies, %d micro-batches; fit lengths %s",
        device,
        f" ({CPU_NOTE.format(cap=max_len, max_seq_len=training['max_seq_len'])})"
        if cpu_only
        else "",
        plans["strategy"].nunique(),
        len(plans),
        fit_lengths,
    )

    # the positive control first: cheap, and a broken estimator must not cost a GPU run
    control = synthetic_control_first(plans, replay_cfg, grad_accum, fit_lengths, micro)

    invalid = {}
    reason = packing_validity(read_json(inputs["gate"]), str(inputs["gate"]))
    if reason:
        invalid[pl.PACKING] = reason

    idle = check_idle_card(profile, device, card_probe, sleep)
    if cpu_only:
        torch.set_num_threads(int(replay_cfg["cpu"]["threads"]))
    torch.manual_seed(settings.seed)
    dtype, dtype_reason = replay_dtype(profile["dtype"], device)
    model_runner, vocab_size, pad_id, harness_info = load_step(
        cfg, model_path, device, dtype, max_len if cpu_only else None, settings.seed
    )
    runner = ReplayRunner(
        model_runner, vocab_size, pad_id, settings.seed, int(replay_cfg["repeats"])
    )
    changes = add_step_changes(runner, plans, inputs, training, replay_cfg, cpu_only, max_len)
    if changes:
        plans = pd.concat([plans, changes.plans], ignore_index=True)

    random_plan = plans[plans["strategy"] == pl.BASELINE]
    loss_share = float(random_plan["loss_tokens"].sum()) / float(random_plan["real_tokens"].sum())
    if training.get("loss_on") == "all":
        loss_share = 1.0
    fit, fit_points = measure_fit(
        runner,
        fit_lengths,
        micro,
        loss_share,
        fit_repeats,
        settings.seed,
        settings.bootstrap_resamples,
    )
    LOG.info("fit %s: a=%.3g b=%.3g c=%.3g", fit.fit.method, fit.fit.a, fit.fit.b, fit.fit.c)

    # the instrument's own spread, on random's median micro-batch (the model is warm from the fit)
    instrument = measure_instrument(
        runner,
        median_row(plans, pl.BASELINE),
        int(replay_cfg["instrument_repeats"]),
        max(settings.warmup, 1),
    )
    cv = instrument["cv"] if math.isfinite(instrument["cv"]) else 0.0
    cv_df = max(instrument["repeats"] - 1.0, 1.0)
    LOG.info("instrument CV %.3f over %d identical micro-batches", cv, instrument["repeats"])

    section = replay_cfg["cpu"] if cpu_only else replay_cfg
    design = build_design(plans, settings.n_strata, settings.seed)
    valid = [name for name in design.strategies if name not in invalid]
    sequential = run_sequential(
        runner,
        design,
        settings,
        valid,
        cv,
        cv_df,
        float(section["budget_s"]),
        0,
        int(section["round_size"]),
        progress=progress,
        per_strategy=settings.n_strata * settings.samples_per_stratum,
    )
    steps, optimizer_times = sequential.steps, sequential.optimizer_times
    LOG.info(
        "replayed %d micro-batches in %d round(s), stopped by %s",
        len(steps),
        sequential.record["rounds"],
        sequential.record["stopped_by"],
    )
    pricing = FitPricing(fit.fit, micro, fit.low, fit.high)
    table = strategy_table(
        plans,
        steps,
        optimizer_times,
        settings,
        invalid,
        pricing,
        cpu_only,
        max_len,
        greg=sequential.estimates,
        stopped_by=sequential.record["stopped_by"],
        instrument_cv=cv,
    )

    # the coverage control: the same design and estimator on simulated timings of known cost
    coverage = coverage_control(
        design, sequential, cv, len(optimizer_times), replay_cfg, settings.seed
    )
    control["coverage"] = coverage
    control["instrument"] = instrument
    control["stopping"] = sequential.record
    control["checks"] = control_checks(control, coverage)
    titles = {c.strategy: f"step-level change: {c.title}" for c in changes.changes}
    table["note"] = [
        f"{titles[s]}; {n}" if s in titles and n else titles.get(s, n)
        for s, n in zip(table["strategy"], table["note"], strict=True)
    ]
    if cpu_only:
        note = CPU_NOTE.format(cap=max_len, max_seq_len=training["max_seq_len"])
        table["note"] = [f"{note}; {n}" if n else note for n in table["note"]]

    all_steps = steps_table(steps, optimizer_times, fit_points)
    fit_row = fit_table_row(fit, micro, loss_share, cpu_only, max_len, replay_cfg)
    run_info = run_metadata(dict(cfg))
    provenance = {
        **run_info,
        "device": device_description(device),
        "cpu_only": cpu_only,
        "dtype": str(dtype).replace("torch.", ""),
        "dtype_reason": dtype_reason,
        "max_seq_len_replayed": max_len,
        "harness": harness_info,
        "step_changes": [
            {"strategy": c.strategy, "title": c.title, "settings": c.settings}
            for c in changes.changes
        ],
        "not_measured": {
            name: "GPU only: not measured on this device" for name in changes.not_measured
        },
        "idle_check": idle,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "wall_s": time.perf_counter() - started,
    }
    control["observed"]["cpu_only"] = cpu_only
    # the report shows and applies the threshold the replay used (its one home: the config)
    control["host_bound_threshold"] = float(replay_cfg["host_bound_threshold"])
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("estimates", table, provenance)
        out.parquet("steps", all_steps, provenance)
        out.parquet("fit", pd.DataFrame([fit_row]), provenance)
        out.json("control", control)
    return {
        "cpu_only": cpu_only,
        "wall_s": provenance["wall_s"],
        "load_average": provenance["load_average"],
        "control_passed": control["passed"],
        "strategies": table[
            [
                "strategy",
                "estimated_time_s",
                "ci_low_s",
                "ci_high_s",
                "saving_vs_random",
                "saving_ci_low",
                "saving_ci_high",
                "rank",
                "valid",
            ]
        ].to_dict("records"),
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
