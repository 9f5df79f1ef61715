"""The realize stage: real training steps of the baseline and the replay's top changes, and the
realized saving beside the promised one.

Order of work: the replay's per-strategy table -> the changes to check (the best measured
savings, recommended ones first, at most ``realize.max_changes``; ``cpu_max_changes`` on CPU)
-> the replay's own plans (capped on CPU exactly as the replay capped them) -> idle-card check
-> weights and the user's harness (the replay's loader) -> a simple random sample of each
strategy's optimizer steps, each run whole (probes.realize.steps), interleaved across strategies
-> epoch estimates with intervals (probes.realize.sample) -> verdicts (probes.realize.verdict)
-> outputs, all or nothing.

``realize.enabled: false``, or a replay without a baseline, writes a not-run note instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.contracts import (
    PAD_TO_MAX_SEQ_LEN,
    RANDOM,
    STAGE_OUTPUTS,
    check_table_columns,
    table_columns,
)
from probes.errors import ControlFailedError, ProbeError
from probes.io import read_parquet, run_metadata
from probes.realize import sample as sm
from probes.realize import verdict as vd
from probes.realize.control import CONTROL_NAME, run_control
from probes.realize.promise import step_promises
from probes.realize.steps import StepTimer
from probes.settings import WorkflowConfig
from probes.stage import all_or_nothing
from probes.step.idle import check_idle_card
from probes.step.timing import OK

LOG = logging.getLogger("probes.realize")
OUTPUT_KEYS = tuple(STAGE_OUTPUTS["realize"])
INPUT_KEYS = ("estimates", "units", "plans", "lengths", "recommendation")
REALIZED_COLUMNS = table_columns("realize_realized")
STEP_COLUMNS = table_columns("realize_steps")
NOT_RUN, RAN = "not_run", "ran"


class RealizeError(ProbeError, RuntimeError):
    """The stage cannot run as configured; nothing was written."""


# ---------------------------------------------------------------------------------------------
# What to check
# ---------------------------------------------------------------------------------------------


def select_changes(estimates: pd.DataFrame, max_changes: int) -> list[str]:
    """The changes to check, best first: the valid strategies (not the baseline, not the
    inverted pad_to_max_seq_len row) with the largest measured saving, a saving above 0. Those
    the Summary recommends (interval above 0) come first; with none, the best measured ones are
    still checked, so an interval too wide to recommend is confronted with real steps."""
    rows = estimates[
        estimates["valid"].fillna(False).astype(bool)
        & ~estimates["strategy"].isin([RANDOM, PAD_TO_MAX_SEQ_LEN])
        & (pd.to_numeric(estimates["saving_vs_random"], errors="coerce") > 0)
    ].copy()
    rows["_recommended"] = pd.to_numeric(rows["saving_ci_low"], errors="coerce") > 0
    rows = rows.sort_values(["_recommended", "saving_vs_random"], ascending=False, kind="stable")
    return [str(s) for s in rows["strategy"].head(max(int(max_changes), 0))]


def step_rows(plan: pd.DataFrame) -> list[list[Any]]:
    """One strategy's plan as its optimizer steps in epoch order, each its micro-batch rows in
    order (itertuples rows, what probes.replay.timing.build_batch takes)."""
    ordered = plan.sort_values("micro_batch_index", kind="stable")
    steps: dict[int, list[Any]] = {}
    for row in ordered.itertuples():
        steps.setdefault(int(row.optimizer_step_index), []).append(row)
    return [steps[k] for k in sorted(steps)]


def run_order(samples: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
    """(strategy, step index) round-robin over the strategies, each strategy's steps in the
    order given: drift of the machine over the run spreads over every strategy."""
    order = []
    longest = max((len(v) for v in samples.values()), default=0)
    for i in range(longest):
        for name, picked in samples.items():
            if i < len(picked):
                order.append((name, int(picked[i])))
    return order


# ---------------------------------------------------------------------------------------------
# Timing and estimates (any StepRunner: the real model's, or a synthetic harness's)
# ---------------------------------------------------------------------------------------------


def measure(
    timer: StepTimer,
    plans: pd.DataFrame,
    strategies: Sequence[str],
    sample_size: int,
    warmup: int,
    seed: int,
    budget_s: float = 0.0,
) -> pd.DataFrame:
    """Time a simple random sample of `sample_size` optimizer steps of each strategy, whole and
    back to back (after `warmup` untimed one-micro-batch steps at the largest sampled
    micro-batch; nothing between steps); then one more step of each per round while the steps
    timed so far plus one more round's mean stay within `budget_s`. One row per step."""
    rng = np.random.default_rng(seed)
    all_steps = {s: step_rows(plans[plans["strategy"] == s]) for s in strategies}
    orders = {s: sm.step_order(len(v), sample_size, rng) for s, v in all_steps.items()}
    order = run_order({s: picked[:sample_size] for s, picked in orders.items()})
    if warmup:  # the largest sampled micro-batch first, so memory is allocated once
        largest = max(
            (row for s, i in order for row in all_steps[s][i]), key=lambda r: r.computed_tokens
        )
        for _ in range(warmup):
            timer.run([largest])
    records: list[dict[str, Any]] = []
    taken = sample_size  # steps of each strategy so far: one per round
    while order:
        for name, index in order:
            records.append(time_one(timer, all_steps[name][index], name, index, len(records)))
        spent = sum(r["time_s"] for r in records if r["status"] == OK)
        if not spent + spent / taken <= budget_s:  # another round would pass the budget
            break
        order = run_order({s: picked[taken : taken + 1] for s, picked in orders.items()})
        taken += 1
    return pd.DataFrame(records, columns=list(STEP_COLUMNS))


def time_one(
    timer: StepTimer, rows: Sequence[Any], name: str, index: int, position: int
) -> dict[str, Any]:
    """One whole step's row of the steps table."""
    return {
        "strategy": name,
        "optimizer_step_index": index,
        "run_order": position,
        "micro_batches": len(rows),
        "computed_tokens": int(sum(r.computed_tokens for r in rows)),
        **timer.time_step(rows),
    }


def step_sizes(plan: pd.DataFrame) -> pd.Series:
    """Every optimizer step's size: the tokens its micro-batches compute over (exact)."""
    return plan.groupby("optimizer_step_index")["computed_tokens"].sum()


def step_auxiliaries(plans: pd.DataFrame, promises: pd.Series | None) -> dict[str, pd.Series]:
    """Per strategy, every optimizer step's auxiliary, indexed by step: the replay's promise for
    its micro-batches (probes.realize.promise), or without one the step's size."""
    if promises is None:
        return {name: step_sizes(plan) for name, plan in plans.groupby("strategy")}
    return {name: promises.xs(name, level="strategy") for name in plans["strategy"].unique()}


def rest_of_step(ok: pd.DataFrame) -> pd.Series:
    """Each step's wall time beyond its micro-batches: the optimizer and what lies between."""
    return ok["time_s"] - ok["micro_batch_s"]


def epoch_estimates(
    steps: pd.DataFrame, aux: Mapping[str, pd.Series]
) -> dict[str, tuple[sm.EpochEstimate, vd.Phases]]:
    """Each timed strategy's epoch estimate and phases (probes.realize.sample): the relative
    residual of each phase pooled over every strategy's steps."""
    ok = steps[steps["status"] == OK]
    timed = {name: ok[ok["strategy"] == name] for name in aux}
    pooled = (
        sm.pooled_residual(
            (own["micro_batch_s"], aux[name].loc[own["optimizer_step_index"]])
            for name, own in timed.items()
        ),
        sm.pooled_residual((rest_of_step(own), np.ones(len(own))) for own in timed.values()),
    )
    return {name: realized_phases(own, aux[name], pooled) for name, own in timed.items()}


def realized_phases(
    ok: pd.DataFrame,
    aux: pd.Series,
    pooled: tuple[sm.PooledResidual | None, sm.PooledResidual | None] = (None, None),
) -> tuple[sm.EpochEstimate, vd.Phases]:
    """The epoch estimate of one strategy's timed OK steps and its phases: the micro-batches
    by the ratio to their promise (`aux`, every step's), the rest of the step (the same each
    step) by its mean, the total their sum (probes.realize.sample.phase_sum); the optimizer
    phase by its mean."""
    if ok.empty:  # every sampled step ran out of memory: nothing realized
        nan = math.nan
        return sm.EpochEstimate(nan, nan, nan, nan, 0, len(aux), None, "none"), vd.Phases(
            nan, nan, nan
        )
    steps = len(aux)
    sampled = aux.loc[ok["optimizer_step_index"]]
    micro = sm.epoch_estimate(ok["micro_batch_s"], steps, sampled, aux, pooled[0])
    other = sm.epoch_estimate(rest_of_step(ok), steps, np.ones(len(ok)), np.ones(steps), pooled[1])
    estimate = sm.phase_sum(micro, other)
    optimizer = sm.epoch_estimate(ok["optimizer_s"], steps).total_s
    return estimate, vd.Phases(
        micro.total_s, optimizer, estimate.total_s - micro.total_s - optimizer
    )


def _num(row: Mapping[str, Any], key: str) -> float:
    value = pd.to_numeric(pd.Series([row.get(key)]), errors="coerce").iloc[0]
    return float(value) if pd.notna(value) else math.nan


def promise_of(row: Mapping[str, Any]) -> vd.Phases:
    return vd.promised_phases(
        _num(row, "estimated_time_s"), _num(row, "optimizer_steps"), _num(row, "optimizer_step_s")
    )


def realized_table(
    steps: pd.DataFrame,
    estimates: pd.DataFrame,
    plans: pd.DataFrame,
    changes: Sequence[str],
    agree_within: float,
    cpu_only: bool,
    max_seq_len: int,
    promises: pd.Series | None = None,
) -> pd.DataFrame:
    """Promised vs realized per strategy, baseline first (REALIZED_COLUMNS); `promises`: the
    replay's per-step promise (probes.realize.promise), the estimator's auxiliary."""
    promised = estimates.set_index("strategy")
    aux = step_auxiliaries(plans[plans["strategy"].isin([RANDOM, *changes])], promises)
    realized = epoch_estimates(steps, aux)
    base_estimate, base_phases = realized[RANDOM]
    base_promise = promise_of(promised.loc[RANDOM].to_dict())
    rows = []
    for name in (RANDOM, *changes):
        own = steps[steps["strategy"] == name]
        failed = int((own["status"] != OK).sum())
        estimate, phases = realized[name]
        prow = promised.loc[name].to_dict()
        promise = promise_of(prow)
        baseline = name == RANDOM
        row = {
            "strategy": name,
            "role": vd.BASELINE_ROLE if baseline else vd.CHANGE_ROLE,
            "optimizer_steps": len(aux[name]),
            "sampled_steps": estimate.sampled,
            "realized_time_s": estimate.total_s,
            "realized_ci_low_s": estimate.low_s,
            "realized_ci_high_s": estimate.high_s,
            "promised_time_s": _num(prow, "estimated_time_s"),
            "promised_ci_low_s": _num(prow, "ci_low_s"),
            "promised_ci_high_s": _num(prow, "ci_high_s"),
            "realized_micro_batch_s": phases.micro_batch,
            "realized_optimizer_s": phases.optimizer,
            "realized_rest_s": phases.rest,
            "promised_micro_batch_s": promise.micro_batch,
            "promised_optimizer_s": promise.optimizer,
            "cpu_only": cpu_only,
            "estimator": estimate.method,
            "max_seq_len": max_seq_len,
            "note": f"{failed} sampled step(s) ran out of memory" if failed else "",
        }
        if baseline:
            saving = (0.0, 0.0, 0.0)
            row.update(promised_saving=0.0, promised_saving_ci_low=0.0, promised_saving_ci_high=0.0)
            row.update(verdict=vd.BASELINE_ROLE, differed="")
            shares = dict.fromkeys(vd.PHASES, math.nan)
        else:
            saving = sm.saving_estimate(estimate, base_estimate)
            p_save, p_low, p_high = (
                _num(prow, k) for k in ("saving_vs_random", "saving_ci_low", "saving_ci_high")
            )
            row.update(
                promised_saving=p_save, promised_saving_ci_low=p_low, promised_saving_ci_high=p_high
            )
            verdict = vd.verdict(
                saving[0],
                p_save,
                p_low,
                p_high,
                agree_within,
                realized_low=saving[1],
                realized_high=saving[2],
            )
            shares = vd.phase_shares(promise, base_promise, phases, base_phases)
            differed = vd.what_differed(shares) if verdict == vd.DISAGREES else ""
            if failed:
                verdict, differed = vd.DISAGREES, row["note"]
            row.update(verdict=verdict, differed=differed)
            row["promise_in_realized_interval"] = bool(saving[1] <= p_save <= saving[2])
        row.update(
            realized_saving=saving[0],
            realized_saving_ci_low=saving[1],
            realized_saving_ci_high=saving[2],
            diff_micro_batch_pp=shares["micro_batch"],
            diff_optimizer_pp=shares["optimizer"],
            diff_rest_pp=shares["rest"],
        )
        rows.append(row)
    return pd.DataFrame(rows, columns=list(REALIZED_COLUMNS))


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def write_not_run(outputs: Mapping[str, str | Path], reason: str, cfg: Mapping[str, Any]) -> None:
    meta = run_metadata(dict(cfg))
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("realized", pd.DataFrame(columns=list(REALIZED_COLUMNS)), meta)
        out.parquet("steps", pd.DataFrame(columns=list(STEP_COLUMNS)), meta)
        out.json("summary", {"status": NOT_RUN, "reason": reason})
        out.json("control", {"status": NOT_RUN, "reason": reason, "name": CONTROL_NAME})


def read_estimates(path: str | Path) -> pd.DataFrame:
    frame = read_parquet(path)
    check_table_columns(frame.columns, "replay_estimates", path)
    return frame


def read_units(path: str | Path) -> pd.DataFrame:
    """The replay's timed units (its micro-batches, optimizer steps and fit points)."""
    frame = read_parquet(path)
    check_table_columns(frame.columns, "replay_steps", path)
    return frame


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    """The stage's entry (probes.stage.main): model directory from the tokenizer input."""
    summary = run_realize(inputs, outputs, cfg, Path(inputs["tokenizer"][0]).parent)
    LOG.info("realize summary: %s", summary)


def load_real_runner(
    model_path: str | Path, raw: Mapping[str, Any], device: torch.device, max_length: int
) -> tuple[Any, int, int, dict[str, Any], str, str]:
    """The replay's step (the user's trainer, or the harness on the real model), its dtype."""
    from probes.replay.stage import replay_dtype
    from probes.step.load import load_step

    dtype, reason = replay_dtype(raw["profile"]["dtype"], device)
    runner, vocab, pad_id, step = load_step(raw, model_path, device, dtype, max_length)
    return runner, vocab, pad_id, step, str(dtype).replace("torch.", ""), reason


def with_step_change_plans(
    plans: pd.DataFrame,
    changes: Sequence[str],
    inputs: Mapping[str, Any],
    training: Mapping[str, Any],
    cpu_only: bool,
    max_len: int,
) -> pd.DataFrame:
    """The device's plans with the rows of the step-level changes among `changes` (the replay's
    own builder: probes.replay.stage.change_plans_for)."""
    from probes.replay.combined import plans_at_shape
    from probes.replay.step_changes import change_plans_for
    from probes.step import changes as sc
    from probes.step import combined as cb

    micro, accum = int(training["micro_batch_size"]), int(training["grad_accum"])
    shapes = sc.plan_shapes(changes, micro, accum)
    added = [change_plans_for(shapes, plans, inputs, training, cpu_only, max_len)] if shapes else []
    for name in filter(cb.is_combined, changes):
        shape = cb.micro_shape(sc.plan_shapes(cb.parse(name).steps, micro, accum), micro, accum)
        at = {shape: plans_at_shape(inputs, training, max_len if cpu_only else None, shape)}
        added.append(cb.combined_plan(cb.parse(name), plans, at, shape, (micro, accum)))
    return pd.concat([plans, *added], ignore_index=True) if added else plans


def step_switch(runner: Any, changes: Sequence[str], training: Mapping[str, Any]) -> Any:
    """The loaded step set per strategy: each step-level change the replay priced, by name."""
    from probes.replay.step_changes import step_changes_for
    from probes.step import changes as sc
    from probes.step import combined as cb

    parts = {n: cb.parse(n).steps if cb.is_combined(n) else (n,) for n in changes}
    wanted = {n: p for n, p in parts.items() if any(sc.is_step_change(s) for s in p)}
    if not wanted:
        return None
    switch = sc.StepSwitch(runner)
    known = {c.strategy: c for c in step_changes_for(switch.base, training)}
    missing = sorted({s for p in wanted.values() for s in p} - set(known))
    if missing:
        raise RealizeError(
            f"realize: the replay priced {missing} against another base step than the one "
            f"loaded now ({switch.base}); rerun replay and realize together"
        )
    switch.configs = {
        name: cb.merged_config(switch.base, [known[s] for s in steps])
        for name, steps in wanted.items()
    }
    return switch


def device_plans(
    inputs: Mapping[str, Any], raw: Mapping[str, Any], changes: Sequence[str], cpu_only: bool
) -> tuple[pd.DataFrame, int]:
    """The replay's plans on this device, the step-level changes' among them; every change
    the replay ranks must have one."""
    from probes.replay.stage import plans_for_device

    training = raw["training"]
    plans, max_len = plans_for_device(
        inputs, training, cpu_only, int(raw["replay"]["cpu"]["max_seq_len"])
    )
    plans = with_step_change_plans(plans, changes, inputs, training, cpu_only, max_len)
    unknown = sorted(set(changes) - set(plans["strategy"]))
    if unknown:
        raise RealizeError(
            f"{inputs['plans']}: no plan for {unknown} that {inputs['estimates']} ranks; rerun "
            "bucket_sweep and replay together"
        )
    return plans, max_len


def control_first(
    plans: pd.DataFrame,
    strategies: Sequence[str],
    settings: Any,
    raw: Mapping[str, Any],
    promises: Any,
) -> dict[str, Any]:
    """The positive control: no wall time, and a broken estimator must not cost a GPU run."""
    control = run_control(
        plans,
        strategies,
        settings.control_steps,
        settings.seed,
        int(raw["training"]["grad_accum"]),
        settings.control_tolerance,
        promises,
    )
    LOG.info("control %s", "passed" if control["passed"] else "FAILED")
    if not control["passed"]:
        raise ControlFailedError(
            f"realize: positive control failed, no output written: {control['observed']}"
        )
    return control


def realize_summary(
    table: pd.DataFrame,
    steps: pd.DataFrame,
    changes: Sequence[str],
    settings: Any,
    cpu_only: bool,
    sample_size: int,
    budget_s: float,
) -> dict[str, Any]:
    """summary.json: each change's verdict and how many steps were sampled."""
    verdicts = {
        str(r.strategy): str(r.verdict) for r in table.itertuples() if r.role == vd.CHANGE_ROLE
    }
    return {
        "status": RAN,
        "verdicts": verdicts,
        "changes": list(changes),
        "cpu_only": cpu_only,
        "sample_steps": int(steps.groupby("strategy").size().max()),
        "first_sample_steps": sample_size,
        "budget_s": budget_s,
        "warmup": settings.warmup,
        "agree_within": settings.agree_within,
    }


def run_realize(
    inputs: Mapping[str, Any],
    outputs: Mapping[str, str | Path],
    cfg: WorkflowConfig,
    model_path: str | Path,
    load: Callable[..., tuple] = load_real_runner,
    card_probe: Callable[[int], Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run the stage and write every output, or none. `load(model_path, raw, device)` returns
    (StepRunner, vocab_size, pad_id, harness description, dtype name, dtype reason) and may add
    a seventh item, the clock the steps are timed with (default perf_counter)."""
    from probes.profile.evidence import device_description
    from probes.step.runner import resolve_device

    missing = [k for k in OUTPUT_KEYS if k not in outputs] + [
        k for k in INPUT_KEYS if k not in inputs
    ]
    if missing:
        raise RealizeError(f"realize: missing path(s) for {missing}")
    raw, settings = cfg.raw, cfg.realize
    if not settings.enabled:
        write_not_run(outputs, "realize.enabled is false", raw)
        return {"status": NOT_RUN}
    estimates = read_estimates(inputs["estimates"])
    if estimates.empty or RANDOM not in set(estimates["strategy"]):
        reason = f"{inputs['estimates']}: the replay measured no '{RANDOM}' baseline"
        write_not_run(outputs, reason, raw)
        return {"status": NOT_RUN, "reason": reason}
    started = time.perf_counter()
    profile, replay_cfg = raw["profile"], raw["replay"]
    device = resolve_device(profile["device"], profile["allow_cpu"])
    cpu_only = device.type != "cuda"
    changes = select_changes(
        estimates, settings.cpu_max_changes if cpu_only else settings.max_changes
    )
    plans, max_len = device_plans(inputs, raw, changes, cpu_only)
    promises = step_promises(plans, read_units(inputs["units"]))
    sample_size = settings.cpu_sample_steps if cpu_only else settings.sample_steps
    LOG.info(
        "realize on %s: baseline + %s, %d sampled optimizer steps each",
        device,
        changes or "no change (none measured faster)",
        sample_size,
    )
    strategies = [RANDOM, *changes]
    # the positive control first: no wall time, and a broken estimator must not cost a GPU run
    control = control_first(plans, strategies, settings, raw, promises)
    idle = check_idle_card(profile, device, card_probe, sleep)
    if cpu_only:
        torch.set_num_threads(int(replay_cfg["cpu"]["threads"]))
    torch.manual_seed(settings.seed)
    runner, vocab, pad_id, harness, dtype, dtype_reason, *clock = load(
        model_path, raw, device, max_len
    )
    timer = StepTimer(runner, vocab, pad_id, settings.seed, *clock)
    timer.switch = step_switch(runner, changes, raw["training"])
    budget_s = settings.cpu_budget_s if cpu_only else 0.0
    steps = measure(timer, plans, strategies, sample_size, settings.warmup, settings.seed, budget_s)
    aux = step_auxiliaries(plans[plans["strategy"].isin(strategies)], promises)
    steps["promised_micro_batch_s"] = [
        float(aux[s].loc[i]) if promises is not None else math.nan
        for s, i in zip(steps["strategy"], steps["optimizer_step_index"], strict=True)
    ]
    table = realized_table(
        steps, estimates, plans, changes, settings.agree_within, cpu_only, max_len, promises
    )
    provenance = {
        **run_metadata(dict(raw)),
        "device": device_description(device),
        "cpu_only": cpu_only,
        "dtype": dtype,
        "dtype_reason": dtype_reason,
        "max_seq_len_replayed": max_len,
        "harness": harness,
        "idle_check": idle,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "wall_s": time.perf_counter() - started,
    }
    summary = realize_summary(table, steps, changes, settings, cpu_only, sample_size, budget_s)
    summary["wall_s"] = provenance["wall_s"]
    with all_or_nothing({key: outputs[key] for key in OUTPUT_KEYS}) as out:
        out.parquet("realized", table, provenance)
        out.parquet("steps", steps, provenance)
        out.json("summary", summary)
        out.json("control", {**control, "observed": {**control["observed"], "cpu_only": cpu_only}})
    return summary
