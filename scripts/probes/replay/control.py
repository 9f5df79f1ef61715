"""Replay's positive control (``run_synthetic_control``): the same sampling, timing and estimator
code on a synthetic harness whose step cost is a known function of the batch shape; the estimate
must recover the exact savings and the scaling fit the known coefficients.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.batching import plans as pl
from probes.replay.estimate import strategy_table
from probes.replay.timing import (
    ReplayRunner,
    ReplaySettings,
    batch_shape,
    measure_fit,
    run_sample,
    sample_all,
)

SPIN_TAIL_S = 0.0003


def wait_until(deadline: float) -> None:
    """Wait until perf_counter() reaches `deadline`: sleep all but the last 0.3 ms, then spin.

    A pure spin is preempted on a shared machine (measured: a 5 ms spin took 12 ms median at load
    8 on 2 cores), and its overshoot would be the machine's load, not the known cost; a sleeping
    thread is rescheduled promptly (same load: 5.003 ms median), and the spin makes it exact.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_TAIL_S:
        time.sleep(remaining - SPIN_TAIL_S)
    while time.perf_counter() < deadline:
        pass


def busy_wait(seconds: float) -> None:
    wait_until(time.perf_counter() + seconds)


@dataclass(frozen=True)
class SyntheticCost:
    """Step cost in seconds: c + b·rows·T + a·rows·T² per micro-batch; a fixed optimizer step."""

    a: float
    b: float
    c: float
    optimizer_s: float

    def micro_batch_s(self, rows: int, length: int) -> float:
        return self.c + self.b * rows * length + self.a * rows * length * length

    @classmethod
    def scaled_to(
        cls,
        plans: pd.DataFrame,
        fixed_s: float = 0.004,
        linear_s: float = 0.003,
        quadratic_s: float = 0.003,
        optimizer_s: float = 0.002,
    ) -> SyntheticCost:
        """Coefficients that give each term `*_s` at the plan's largest padded micro-batch (the
        fit's largest shape too), so every term is a real share of the step (a term lost in
        timer noise would test nothing); flattened packed rows may cost more."""
        padded = plans[plans["layout"] == pl.PADDED]
        shapes = np.array(
            [batch_shape(r) for r in (padded if len(padded) else plans).itertuples()],
            dtype=np.float64,
        )
        linear = float(np.max(shapes[:, 0] * shapes[:, 1]))
        quadratic = float(np.max(shapes[:, 0] * shapes[:, 1] ** 2))
        return cls(quadratic_s / quadratic, linear_s / linear, fixed_s, optimizer_s)


def exact_epoch_s(plans: pd.DataFrame, cost: SyntheticCost, grad_accum: int) -> pd.Series:
    """The analytic epoch time of every strategy over its whole plan."""
    totals = {}
    for name, plan in plans.groupby("strategy", sort=False):
        micro = sum(cost.micro_batch_s(*batch_shape(r)) for r in plan.itertuples())
        # a plan's own optimizer steps where it numbers them (a micro-batch-size change keeps
        # tokens per update with its own gradient accumulation), else grad_accum micro-batches each
        if "optimizer_step_index" in plan:
            steps = int(plan["optimizer_step_index"].nunique())
        else:
            steps = -(-len(plan) // grad_accum)
        totals[name] = micro + steps * cost.optimizer_s
    return pd.Series(totals)


def fit_relative_errors(
    got: Mapping[str, float], truth: Mapping[str, float], longest: int
) -> dict[str, float]:
    """Each fitted coefficient of t(T) = aT² + bT + c against the known one, relative; a term
    the known cost lacks (a = 0: C + K·rows·T) is judged by the share of the known step at the
    longest fit length that the fit gives it, so a spurious term fails as a wrong one does."""
    powers = {"a": 2, "b": 1, "c": 0}
    step = sum(truth[k] * longest ** powers[k] for k in truth)
    return {
        k: abs(got[k] / truth[k] - 1.0) if truth[k] else abs(got[k]) * longest ** powers[k] / step
        for k in truth
    }


def timing_overhead(
    steps: pd.DataFrame, optimizer_times: np.ndarray, cost: SyntheticCost
) -> dict[str, float]:
    """What the timing path adds to the known cost, measured: the mean of (timed − known) over
    the timed micro-batches, and over the optimizer steps. The busy-wait's true cost is the known
    one plus this constant (Python calls, the timer); on the default CPU run 13-35 µs per
    micro-batch, which moves packing's exact saving (fewer micro-batches) by ~0.2 pp."""
    known = np.array([cost.micro_batch_s(*batch_shape(r)) for r in steps.itertuples()])
    timed = steps["time_s"].to_numpy(dtype=np.float64)
    optimizer = np.asarray(optimizer_times, dtype=np.float64)
    return {
        "micro_batch": float(np.mean(timed - known)) if timed.size else 0.0,
        "optimizer_step": float(np.mean(optimizer - cost.optimizer_s)) if optimizer.size else 0.0,
    }


class _SyntheticLoss:
    """What the synthetic compute_loss returns: its backward() ends at the micro-batch's known
    deadline (no autograd graph: the engine's own ~0.3 ms per call on a loaded machine would be
    an unknown cost inside a known one)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def backward(self) -> None:
        wait_until(self.deadline)


class _SyntheticModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))


class _BusyOptimizer(torch.optim.SGD):
    def __init__(self, params: Any, seconds: float) -> None:
        super().__init__(params, lr=0.0)
        self.seconds = seconds

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        self.deadline = time.perf_counter() + self.seconds
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        super().zero_grad(set_to_none=set_to_none)
        wait_until(getattr(self, "deadline", 0.0))  # step + zero_grad end at the known cost


def synthetic_runner(cost: SyntheticCost) -> Any:
    """A StepRunner over a synthetic harness: compute_loss spins for the known cost of the batch
    shape it is given, the optimizer step for the known optimizer cost."""
    from probes.step.harness import Harness
    from probes.step.runner import StepRunner

    def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> _SyntheticLoss:
        start = time.perf_counter()
        rows, length = batch["input_ids"].shape
        return _SyntheticLoss(start + cost.micro_batch_s(int(rows), int(length)))

    harness = Harness(
        spec="probes.replay.control:synthetic",
        module=sys.modules[__name__],
        source_file=__file__,
        discover_target_modules=lambda model: ["weight"],
        compute_loss=compute_loss,
    )
    model = _SyntheticModel()
    optimizer = _BusyOptimizer(model.parameters(), cost.optimizer_s)
    return StepRunner(model, harness, optimizer, torch.device("cpu"))


def run_synthetic_control(
    plans: pd.DataFrame,
    settings: ReplaySettings,
    fit_lengths: Sequence[int],
    fit_rows: int,
    fit_repeats: int = 7,
    saving_tolerance: float = 0.05,
    fit_tolerance: float = 0.10,
    cost: SyntheticCost | None = None,
    repeats: int = 3,
) -> dict[str, Any]:
    """The replay and the fit on a harness whose cost is known: each strategy's estimated
    time ratio to random (1 − saving) within `saving_tolerance` (relative) of the exact one
    computed over the whole plan, and a, b, c within `fit_tolerance`."""
    started = time.perf_counter()
    cost = cost or SyntheticCost.scaled_to(plans)
    # the fastest of `repeats` timings per micro-batch (and per fit length): the synthetic cost
    # is deterministic, so any excess is delay from other processes (one-sided; measured 27-45%
    # of waits late by ~2-3 ms at load 7 on 2 cores), and the control tests the estimator, not
    # the machine's load. Real steps use the median.
    runner = ReplayRunner(synthetic_runner(cost), 64, 0, settings.seed, repeats, "min")
    sample = sample_all(plans, settings)
    steps, optimizer_times = run_sample(runner, sample, settings)
    from probes.replay.estimate import greg_estimate_all
    from probes.replay.sequential import build_design, strategy_designs

    # the same model-assisted estimator as the real replay; the busy-wait has no noise to add
    greg, _ = greg_estimate_all(
        strategy_designs(build_design(plans, settings.n_strata, settings.seed), steps),
        optimizer_times,
        0.0,
        float("inf"),
    )
    table = strategy_table(plans, steps, optimizer_times, settings, greg=greg)
    table = table.set_index("strategy")
    exact = exact_epoch_s(plans, cost, settings.grad_accum)
    overhead = timing_overhead(steps, optimizer_times, cost)
    # what the busy-wait really costs: the known cost plus the measured constant per call
    with_overhead = exact_epoch_s(
        plans,
        dataclasses.replace(
            cost,
            c=cost.c + overhead["micro_batch"],
            optimizer_s=cost.optimizer_s + overhead["optimizer_step"],
        ),
        settings.grad_accum,
    )
    per_strategy = {}
    passed = True
    base = pl.BASELINE
    for name in exact.index:
        exact_ratio = float(exact[name] / exact[base])
        ratio = 1.0 - float(table.loc[name, "saving_vs_random"])
        error = abs(ratio / exact_ratio - 1.0)
        ok = error <= saving_tolerance
        passed &= ok
        per_strategy[name] = {
            "exact_time_s": float(exact[name]),
            "estimated_time_s": float(table.loc[name, "estimated_time_s"]),
            "ci_low_s": float(table.loc[name, "ci_low_s"]),
            "ci_high_s": float(table.loc[name, "ci_high_s"]),
            "exact_saving": 1.0 - exact_ratio,
            "estimated_saving": float(table.loc[name, "saving_vs_random"]),
            "time_ratio_rel_error": error,
            "saving_ci": [
                float(table.loc[name, "saving_ci_low"]),
                float(table.loc[name, "saving_ci_high"]),
            ],
            "exact_saving_inside_interval": bool(
                table.loc[name, "saving_ci_low"] - 1e-9
                <= 1.0 - exact_ratio
                <= table.loc[name, "saving_ci_high"] + 1e-9
            ),
            "exact_saving_with_overhead": 1.0 - float(with_overhead[name] / with_overhead[base]),
            "exact_saving_with_overhead_inside_interval": bool(
                table.loc[name, "saving_ci_low"] - 1e-9
                <= 1.0 - float(with_overhead[name] / with_overhead[base])
                <= table.loc[name, "saving_ci_high"] + 1e-9
            ),
            "passed": ok,
        }
    fit, points = measure_fit(
        runner, fit_lengths, fit_rows, 1.0, fit_repeats, settings.seed, settings.bootstrap_resamples
    )
    truth = {"a": cost.a * fit_rows, "b": cost.b * fit_rows, "c": cost.c}
    got = {"a": fit.fit.a, "b": fit.fit.b, "c": fit.fit.c}
    fit_errors = fit_relative_errors(got, truth, max(fit_lengths))
    fit_ok = fit.fit.usable and all(e <= fit_tolerance for e in fit_errors.values())
    passed &= fit_ok
    return {
        "name": "replay_recovers_known_step_cost",
        "description": (
            "a synthetic harness spins c + b*rows*T + a*rows*T^2 s per micro-batch (and a fixed "
            "optimizer step); the stratified replay of every strategy's real plan must recover "
            "the exact epoch-time ratio to random (computed over the whole plan) and the "
            "scaling fit a, b, c"
        ),
        "expected": {
            "cost": {"a": cost.a, "b": cost.b, "c": cost.c, "optimizer_s": cost.optimizer_s},
            "time_ratio_rel_error_max": saving_tolerance,
            "fit": truth,
            "fit_rel_error_max": fit_tolerance,
            "exact_saving": {k: v["exact_saving"] for k, v in per_strategy.items()},
        },
        "observed": {
            "strategies": per_strategy,
            "timing_overhead_s": overhead,
            "sampled_micro_batches": int(len(steps)),
            "fit": {
                **got,
                "rel_error": fit_errors,
                "lengths": sorted({int(v) for v in points["padded_length"]}),
                "a_ci": fit.a_ci,
                "b_ci": fit.b_ci,
                "c_ci": fit.c_ci,
            },
            "wall_s": time.perf_counter() - started,
        },
        "passed": bool(passed),
    }


# ---------------------------------------------------------------------------------------------
# The coverage control: is the model-assisted estimator's 95% interval honest?
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedCost:
    """A known step cost with terms the working model does not have (loss tokens × length, a
    per-document cost), so the design-based correction is exercised:
    c + b·rows·T + a·rows·T² + d·loss + e·loss·T/T_max + g·documents."""

    a: float
    b: float
    c: float
    d: float
    e: float
    g: float
    t_max: float
    optimizer_s: float

    def micro_batch_s(self, frame: pd.DataFrame) -> np.ndarray:
        from probes.replay.estimate import auxiliaries

        x = auxiliaries(frame)
        length = x[:, 2] / np.maximum(x[:, 1], 1.0)
        loss = x[:, 3]
        docs = frame["n_examples"].to_numpy(np.float64)
        return (
            self.c
            + self.b * x[:, 1]
            + self.a * x[:, 2]
            + self.d * loss
            + self.e * loss * length / self.t_max
            + self.g * docs
        )

    @classmethod
    def scaled_to(cls, plans: pd.DataFrame, optimizer_share: float = 0.2) -> SimulatedCost:
        """Each term a real share of the largest micro-batch (loss terms sized like the issue's
        model, whose LM head makes a micro-batch ~2.5× slower with every token in the loss)."""
        from probes.replay.estimate import auxiliaries

        x = auxiliaries(plans)
        t_max = float(np.max(x[:, 2] / np.maximum(x[:, 1], 1.0)))
        linear, quadratic = float(x[:, 1].max()), float(x[:, 2].max())
        loss = max(float(x[:, 3].max()), 1.0)
        docs = max(float(plans["n_examples"].max()), 1.0)
        c = 0.1
        return cls(
            a=0.15 / quadratic,
            b=0.35 / linear,
            c=c,
            d=0.4 / loss,
            e=0.3 / loss,
            g=0.05 / docs,
            t_max=t_max,
            optimizer_s=optimizer_share,
        )


# Preempted timings in the coverage control's simulated runs: this share of timings comes out
# 10-40% slow (the default CPU run's largest residual was +28%).
SPIKE_SHARE = 0.03


def timing_noise(rng: np.random.Generator, size: int, cv: float, spike_share: float) -> np.ndarray:
    """Multiplicative timing noise: normal at `cv`, and a `spike_share` of timings 10-40% slow."""
    noise = np.maximum(1.0 + cv * rng.standard_normal(size), 0.05)
    spikes = rng.random(size) < spike_share
    return noise * np.where(spikes, 1.0 + rng.uniform(0.1, 0.4, size), 1.0)


def retime_simulated(
    designs: Mapping[str, Any],
    truth: Mapping[str, np.ndarray],
    cv: float,
    spike_share: float,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """The replay's outlier rule on simulated timings: the units estimate.outlier_units flags get
    OUTLIER_TIMINGS timings in all (new noise on their exact cost) and their median."""
    import dataclasses

    from probes.replay.estimate import OUTLIER_TIMINGS, outlier_units, unit_residuals

    names = list(designs)
    residuals = unit_residuals(designs)
    flagged = outlier_units(
        np.concatenate([residuals[n] for n in names]),
        np.concatenate([designs[n].timings for n in names]),
        cv,
    )
    out, start = {}, 0
    for name in names:
        d = designs[name]
        mine = flagged[start : start + d.y.size]
        start += d.y.size
        if not mine.any():
            out[name] = d
            continue
        again = [
            truth[name][mine] * timing_noise(rng, int(mine.sum()), cv, spike_share)
            for _ in range(OUTLIER_TIMINGS - 1)
        ]
        y, timings = d.y.copy(), d.timings.copy()
        y[mine] = np.median(np.column_stack([d.y[mine], *again]), axis=1)
        timings[mine] = OUTLIER_TIMINGS
        out[name] = dataclasses.replace(d, y=y, timings=timings)
    return out


def run_coverage_control(
    design: Any,
    takes: Mapping[tuple[str, int], int],
    cv: float,
    optimizer_timings: int,
    replications: int,
    seed: int,
    threshold: float = 0.9,
    cost: SimulatedCost | None = None,
    spike_share: float = SPIKE_SHARE,
) -> dict[str, Any]:
    """The real plans and the real run's allocation (`takes`), timings simulated from a known
    cost with noise at the measured `cv` and a `spike_share` of preempted timings, through the
    replay's outlier rule and the same estimator `replications` times: the share of 95% saving
    intervals that cover the exact saving, per strategy, must be at least `threshold`. Cheap:
    no model runs."""
    from probes.replay.estimate import StrategyDesign, auxiliaries, greg_estimate_all

    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    all_plans = pd.concat(design.plans.values(), ignore_index=True)
    cost = cost or SimulatedCost.scaled_to(all_plans)
    x = {n: auxiliaries(p) for n, p in design.plans.items()}
    mu = {n: cost.micro_batch_s(p) for n, p in design.plans.items()}
    steps = {n: int(p["optimizer_step_index"].nunique()) for n, p in design.plans.items()}
    exact = {n: float(mu[n].sum()) + steps[n] * cost.optimizer_s for n in design.plans}
    base = pl.BASELINE
    exact_saving = {n: 1.0 - exact[n] / exact[base] for n in exact}
    hits = dict.fromkeys(exact, 0)
    widths: dict[str, list[float]] = {n: [] for n in exact}
    cv_df = 4.0
    for _ in range(replications):
        designs, truth = {}, {}
        for name in design.plans:
            units, strata = [], []
            for h, members in enumerate(design.orders[name]):
                n = int(takes.get((name, h), 0))
                picked = rng.choice(members, size=min(n, members.size), replace=False)
                units.append(picked)
                strata.append(np.full(picked.size, h))
            idx = np.concatenate(units)
            designs[name] = StrategyDesign(
                plan_x=x[name],
                plan_stratum=design.stratum[name],
                optimizer_steps=steps[name],
                stratum=np.concatenate(strata),
                x=x[name][idx],
                y=mu[name][idx] * timing_noise(rng, idx.size, cv, spike_share),
                timings=np.ones(idx.size),
            )
            truth[name] = mu[name][idx]
        designs = retime_simulated(designs, truth, cv, spike_share, rng)
        opt = cost.optimizer_s * np.maximum(
            1.0 + cv * rng.standard_normal(max(optimizer_timings, 2)), 0.05
        )
        estimates, _ = greg_estimate_all(designs, opt, cv, cv_df)
        for name, est in estimates.items():
            inside = est.saving_low - 1e-12 <= exact_saving[name] <= est.saving_high + 1e-12
            hits[name] += int(inside)
            widths[name].append(est.saving_high - est.saving_low)
    coverage = {n: hits[n] / replications for n in exact if n != base}
    passed = bool(coverage) and min(coverage.values()) >= threshold
    return {
        "name": "replay_intervals_cover_the_exact_saving",
        "description": (
            "timings simulated from a known cost (rows*T, rows*T^2, loss tokens, loss tokens x "
            "length, documents: terms the working model lacks) with noise at the measured CV and "
            "a share of preempted timings (10-40% slow) through the replay's outlier rule, "
            "sampled with the real run's allocation and priced by the same model-assisted "
            "estimator; the share of 95% saving intervals covering the exact saving, per strategy"
        ),
        "expected": {
            "coverage_min": threshold,
            "nominal": 0.95,
            "cv": cv,
            "spike_share": spike_share,
            "replications": replications,
            "exact_saving": exact_saving,
        },
        "observed": {
            "coverage": coverage,
            "min_coverage": min(coverage.values()) if coverage else float("nan"),
            "mean_width_pp": {n: 100 * float(np.mean(w)) for n, w in widths.items() if n != base},
            "wall_s": time.perf_counter() - started,
        },
        "passed": passed,
    }
