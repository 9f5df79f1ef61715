"""Realize's estimates: each timed strategy's epoch estimate and phases from its sampled steps
(probes.realize.sample), and the promised-vs-realized table (``realized_table``, one row per
strategy, baseline first: ``REALIZED_COLUMNS``) with each change's verdict (probes.realize.verdict).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from probes.contracts import RANDOM, table_columns
from probes.realize import sample as sm
from probes.realize import verdict as vd
from probes.step.timing import OK

REALIZED_COLUMNS = table_columns("realize_realized")
LOG = logging.getLogger("probes.realize")


def step_sizes(plan: pd.DataFrame) -> pd.Series:
    """Every optimizer step's size: the tokens its micro-batches compute over (exact)."""
    return plan.groupby("optimizer_step_index")["computed_tokens"].sum()


def step_auxiliaries(plans: pd.DataFrame, promises: pd.Series | None) -> dict[str, pd.Series]:
    """Per strategy, every optimizer step's auxiliary, indexed by step: the replay's promise for
    its micro-batches (probes.realize.promise), or without one the step's size. A ratio
    estimator divides by its auxiliary, so a strategy whose promise is not positive at every
    step (the working model extrapolated below zero) takes its step sizes instead."""
    if promises is None:
        return {name: step_sizes(plan) for name, plan in plans.groupby("strategy")}
    aux = {}
    for name, plan in plans.groupby("strategy", sort=False):
        promised = promises.xs(name, level="strategy")
        if not (promised > 0).all():
            LOG.warning(
                "realize: %s: %d of %d steps promised no positive time; its step sizes are "
                "the estimator's auxiliary instead", name, int((~(promised > 0)).sum()),
                len(promised),
            )  # fmt: skip
            promised = step_sizes(plan)
        aux[name] = promised
    return aux


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


# ---------------------------------------------------------------------------------------------
# Promised vs realized
# ---------------------------------------------------------------------------------------------


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
    baseline = (*realized[RANDOM], promise_of(promised.loc[RANDOM].to_dict()))
    rows = []
    for name in (RANDOM, *changes):
        own = steps[steps["strategy"] == name]
        failed = int((own["status"] != OK).sum())
        prow = promised.loc[name].to_dict()
        row = measured_columns(name, prow, realized[name], len(aux[name]), failed)
        row.update(cpu_only=cpu_only, max_seq_len=max_seq_len)
        if name == RANDOM:
            row.update(baseline_columns())
        else:
            row.update(change_columns(prow, realized[name], baseline, agree_within, row["note"]))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(REALIZED_COLUMNS))


def measured_columns(
    name: str,
    prow: Mapping[str, Any],
    realized: tuple[sm.EpochEstimate, vd.Phases],
    optimizer_steps: int,
    failed: int,
) -> dict[str, Any]:
    """One strategy's realized epoch and phases beside its promised ones (any role)."""
    estimate, phases = realized
    promise = promise_of(prow)
    return {
        "strategy": name,
        "role": vd.BASELINE_ROLE if name == RANDOM else vd.CHANGE_ROLE,
        "optimizer_steps": optimizer_steps,
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
        "estimator": estimate.method,
        "note": f"{failed} sampled step(s) ran out of memory" if failed else "",
    }


def baseline_columns() -> dict[str, Any]:
    """The baseline's saving columns: zero against itself, no verdict of its own."""
    return {
        "promised_saving": 0.0,
        "promised_saving_ci_low": 0.0,
        "promised_saving_ci_high": 0.0,
        "verdict": vd.BASELINE_ROLE,
        "differed": "",
        **saving_columns((0.0, 0.0, 0.0), dict.fromkeys(vd.PHASES, math.nan)),
    }


def change_columns(
    prow: Mapping[str, Any],
    realized: tuple[sm.EpochEstimate, vd.Phases],
    baseline: tuple[sm.EpochEstimate, vd.Phases, vd.Phases],
    agree_within: float,
    failure_note: str,
) -> dict[str, Any]:
    """A change's realized saving against the baseline's (`baseline`: its estimate, phases and
    promise), the promised one, the verdict and which phase differed; a change with a step that
    ran out of memory disagrees, naming that."""
    (estimate, phases), (base_estimate, base_phases, base_promise) = realized, baseline
    saving = sm.saving_estimate(estimate, base_estimate)
    p_save, p_low, p_high = (
        _num(prow, k) for k in ("saving_vs_random", "saving_ci_low", "saving_ci_high")
    )
    verdict = vd.verdict(
        saving[0], p_save, p_low, p_high, agree_within,
        realized_low=saving[1], realized_high=saving[2],
    )  # fmt: skip
    shares = vd.phase_shares(promise_of(prow), base_promise, phases, base_phases)
    differed = vd.what_differed(shares) if verdict == vd.DISAGREES else ""
    if failure_note:
        verdict, differed = vd.DISAGREES, failure_note
    return {
        "promised_saving": p_save,
        "promised_saving_ci_low": p_low,
        "promised_saving_ci_high": p_high,
        "verdict": verdict,
        "differed": differed,
        "promise_in_realized_interval": bool(saving[1] <= p_save <= saving[2]),
        **saving_columns(saving, shares),
    }


def saving_columns(
    saving: tuple[float, float, float], shares: Mapping[str, float]
) -> dict[str, float]:
    """The realized saving with its interval, and each phase's share of the difference (pp)."""
    return {
        "realized_saving": saving[0],
        "realized_saving_ci_low": saving[1],
        "realized_saving_ci_high": saving[2],
        "diff_micro_batch_pp": shares["micro_batch"],
        "diff_optimizer_pp": shares["optimizer"],
        "diff_rest_pp": shares["rest"],
    }
