"""Realize's timing loop: a simple random sample of each strategy's optimizer steps, each run
whole (probes.realize.steps.StepTimer), interleaved across strategies; any StepRunner (the real
model's, or the control's synthetic harness). One row per step (``STEP_COLUMNS``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from probes.contracts import table_columns
from probes.realize import sample as sm
from probes.realize.steps import StepTimer
from probes.step.timing import OK

STEP_COLUMNS = table_columns("realize_steps")


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
