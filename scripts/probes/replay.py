"""Replay: price each batching strategy by timing a stratified sample of its real micro-batches.

What is measured: forward + backward through the harness's own ``compute_loss`` for each sampled
micro-batch (shapes, padding side, packing boundaries and loss-token counts are the plan's real
ones; token values are random), and the optimizer step on its own.

What is estimated: an epoch's time, Σ over strata (micro-batches in the stratum × mean measured
time) + optimizer steps × mean optimizer-step time. Strata are log-spaced bands of the tokens a
micro-batch computes over, so rare large micro-batches are sampled as often as common small ones
and weighted by how many there really are.

What the interval means: a 95% percentile bootstrap, resampling the measured times within each
stratum (and the optimizer times): the spread an estimate from this many samples has. Savings
against random use the same bootstrap replicate for both strategies (joint), so the shared
optimizer measurement cancels instead of widening the interval. It does not cover a systematic
error shared by every measurement (another process on the machine, a different card).

The positive control (``run_synthetic_control``) runs the same code on a synthetic harness whose
step cost is a known function of the batch shape; the estimate must recover the exact savings and
the scaling fit the known coefficients.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes import batches as bt
from probes import fit as ft
from probes import plans as pl
from probes.timing import OK, OOM, is_out_of_memory, release_memory, synchronize, wall_time

HOST_BOUND_THRESHOLD = 0.7
CONFIDENCE = 0.95
MICRO_BATCH, OPTIMIZER_STEP, FIT_POINT = "micro_batch", "optimizer_step", "fit_point"
TIMER = "host wall between device synchronisations (probes.timing.wall_time)"

REPLAY_COLUMNS = (
    "strategy",
    "valid",
    "invalid_reason",
    "micro_batches",
    "sampled",
    "strata",
    "estimated_time_s",
    "ci_low_s",
    "ci_high_s",
    "saving_vs_random",
    "saving_ci_low",
    "saving_ci_high",
    "rank",
    "tie_group",
    "optimizer_steps",
    "optimizer_step_s",
    "tokens_per_optimizer_step",
    "grad_accum",
    "grad_accum_for_same_tokens",
    "real_tokens",
    "computed_tokens",
    "gpu_busy_share",
    "host_bound_share",
    "fit_predicted_saving",
    "fit_predicted_time_s",
    "fit_agrees",
    "fit_reason",
    "cpu_only",
    "max_seq_len",
    "note",
)


# ---------------------------------------------------------------------------------------------
# Strata and the sample
# ---------------------------------------------------------------------------------------------


def stratum_edges(sizes: np.ndarray, n_strata: int) -> np.ndarray:
    """n_strata + 1 log-spaced edges spanning [min, max] of the sizes (one stratum if constant)."""
    low, high = float(np.min(sizes)), float(np.max(sizes))
    if n_strata < 1:
        raise ValueError(f"n_strata={n_strata}: need at least 1")
    if low <= 0:
        raise ValueError(f"stratum sizes must be positive (min {low})")
    if high <= low:
        return np.array([low, high])
    return np.geomspace(low, high, n_strata + 1)


def assign_strata(sizes: np.ndarray, n_strata: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratum index of every size (0-based, empty strata dropped) and the non-empty edges."""
    edges = stratum_edges(np.asarray(sizes, dtype=np.float64), n_strata)
    raw = np.clip(np.searchsorted(edges, sizes, side="right") - 1, 0, len(edges) - 2)
    used, index = np.unique(raw, return_inverse=True)
    return index.astype(np.int64), np.stack([edges[used], edges[used + 1]], axis=1)


def allocate(counts: np.ndarray, per_stratum: int, budget: int) -> np.ndarray:
    """Samples per stratum: `per_stratum` each (all of a smaller stratum), then what is left of
    the budget (n_strata × per_stratum) in proportion to stratum size, never above a size. A
    plan whose micro-batches crowd into few strata (packing, pad-to-max) is then still sampled
    with the full budget where its micro-batches are."""
    counts = np.asarray(counts, dtype=np.int64)
    alloc = np.minimum(counts, per_stratum)
    left = budget - int(alloc.sum())
    while left > 0 and (alloc < counts).any():
        room = counts - alloc
        weights = np.where(room > 0, counts, 0).astype(np.float64)
        add = np.minimum(np.floor(left * weights / weights.sum()).astype(np.int64), room)
        if add.sum() == 0:
            add[int(np.argmax(weights))] = 1
        alloc += add
        left -= int(add.sum())
    return alloc


def systematic_sample(
    members: np.ndarray, key: np.ndarray, take: int, rng: np.random.Generator
) -> np.ndarray:
    """`take` of `members`, evenly spaced along `key` (loss tokens) from a random start: each
    member is drawn with the same probability take/N (the stratum mean stays unbiased), and the
    sample spans the loss-token range, which a micro-batch's cost also depends on (the head and
    cross-entropy run over the loss tokens). Conservative for the SRS bootstrap."""
    n = members.size
    if take >= n:
        return members.copy()
    order = members[np.argsort(key, kind="stable")]
    step = n / take
    positions = np.floor(rng.uniform(0, step) + step * np.arange(take)).astype(np.int64)
    return order[np.minimum(positions, n - 1)]


def stratified_sample(
    plan: pd.DataFrame, n_strata: int, per_stratum: int, rng: np.random.Generator
) -> pd.DataFrame:
    """A strategy's sampled micro-batches (see `allocate`, `systematic_sample`), without
    replacement, with each row's stratum, the stratum's size and bounds."""
    sizes = plan["computed_tokens"].to_numpy(dtype=np.float64)
    stratum, bounds = assign_strata(sizes, n_strata)
    counts = np.bincount(stratum)
    takes = allocate(counts, per_stratum, n_strata * per_stratum)
    loss = plan["loss_tokens"].to_numpy(dtype=np.float64)
    picked = []
    for h in range(len(counts)):
        members = np.flatnonzero(stratum == h)
        picked.append(np.sort(systematic_sample(members, loss[members], int(takes[h]), rng)))
    chosen = np.concatenate(picked)
    sample = plan.iloc[chosen].copy()
    sample["stratum"] = stratum[chosen]
    sample["stratum_size"] = counts[stratum[chosen]]
    sample["stratum_low_tokens"] = bounds[stratum[chosen], 0]
    sample["stratum_high_tokens"] = bounds[stratum[chosen], 1]
    return sample.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# The estimator and its bootstrap
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrataTimes:
    """One strategy's measurements: per stratum its size and the measured times."""

    sizes: np.ndarray  # micro-batches per stratum in the whole plan
    times: list[np.ndarray]  # measured seconds of the sampled micro-batches, per stratum
    optimizer_steps: int


def strata_times(steps: pd.DataFrame, optimizer_steps: int) -> StrataTimes:
    """From one strategy's rows of the steps table (stratum, stratum_size, time_s)."""
    groups = steps.groupby("stratum", sort=True)
    return StrataTimes(
        sizes=groups["stratum_size"].first().to_numpy(dtype=np.float64),
        times=[g["time_s"].to_numpy(dtype=np.float64) for _, g in groups],
        optimizer_steps=int(optimizer_steps),
    )


def stratified_total(data: StrataTimes, optimizer_mean_s: float) -> float:
    """Σ_h N_h × mean(t_h) + optimizer steps × mean optimizer-step time."""
    micro = sum(n * float(np.mean(t)) for n, t in zip(data.sizes, data.times, strict=True))
    return micro + data.optimizer_steps * optimizer_mean_s


def naive_total(data: StrataTimes, optimizer_mean_s: float) -> float:
    """The estimator that ignores strata: every micro-batch priced at the plain sample mean.
    Biased whenever sampling is not proportional to stratum size; kept for the tests."""
    pooled = np.concatenate(data.times)
    return float(np.sum(data.sizes)) * float(np.mean(pooled)) + (
        data.optimizer_steps * optimizer_mean_s
    )


def bootstrap_means(times: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap replicates of the mean of `times`."""
    times = np.asarray(times, dtype=np.float64)
    draws = rng.integers(0, times.size, size=(resamples, times.size))
    return times[draws].mean(axis=1)


def bootstrap_totals(
    data: StrataTimes, optimizer_replicates: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Replicates of the stratified total, resampling within each stratum; the optimizer mean's
    replicates are passed in so every strategy of one bootstrap shares them (joint bootstrap)."""
    resamples = optimizer_replicates.size
    total = data.optimizer_steps * optimizer_replicates
    for n, times in zip(data.sizes, data.times, strict=True):
        total = total + n * bootstrap_means(times, resamples, rng)
    return total


def percentile_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Estimate:
    time_s: float
    ci_low_s: float
    ci_high_s: float
    replicates: np.ndarray


def estimate_all(
    per_strategy: Mapping[str, StrataTimes],
    optimizer_times: np.ndarray,
    resamples: int,
    seed: int,
    confidence: float = CONFIDENCE,
    total_fn: Callable[[StrataTimes, float], float] = stratified_total,
) -> dict[str, Estimate]:
    """Point estimate and bootstrap interval of every strategy's epoch time (joint replicates)."""
    rng = np.random.default_rng(seed)
    optimizer_times = np.asarray(optimizer_times, dtype=np.float64)
    optimizer_mean = float(np.mean(optimizer_times)) if optimizer_times.size else 0.0
    optimizer_reps = (
        bootstrap_means(optimizer_times, resamples, rng)
        if optimizer_times.size
        else np.zeros(resamples)
    )
    out = {}
    for name, data in per_strategy.items():
        if total_fn is stratified_total:
            replicates = bootstrap_totals(data, optimizer_reps, rng)
        else:  # any other estimator: the same resampling, its own formula on each replicate
            replicates = np.array(
                [
                    total_fn(
                        StrataTimes(
                            data.sizes,
                            [t[rng.integers(0, t.size, t.size)] for t in data.times],
                            data.optimizer_steps,
                        ),
                        float(rep),
                    )
                    for rep in optimizer_reps
                ]
            )
        low, high = percentile_interval(replicates, confidence)
        out[name] = Estimate(total_fn(data, optimizer_mean), low, high, replicates)
    return out


def saving_interval(
    estimate: Estimate, baseline: Estimate, confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """Saving vs the baseline (1 − T/T_base) and its interval from the joint replicates."""
    saving = 1.0 - estimate.time_s / baseline.time_s
    low, high = percentile_interval(1.0 - estimate.replicates / baseline.replicates, confidence)
    return saving, low, high


def rank_with_ties(
    names: Sequence[str], savings: Sequence[float], lows: Sequence[float], highs: Sequence[float]
) -> dict[str, tuple[int, int]]:
    """(rank, tie group) per strategy, by measured saving, best first. A strategy whose interval
    overlaps the interval of its group's best member joins that group (a tie): rank is the
    group's position."""
    order = sorted(range(len(names)), key=lambda i: -savings[i])
    out: dict[str, tuple[int, int]] = {}
    group, leader, leader_rank = 0, None, 0
    for position, i in enumerate(order, 1):
        if leader is None or highs[i] < lows[leader]:
            group += 1
            leader, leader_rank = i, position
        out[names[i]] = (leader_rank, group)
    return out


# ---------------------------------------------------------------------------------------------
# Shapes, batches and the runner
# ---------------------------------------------------------------------------------------------


def batch_shape(row: Any) -> tuple[int, int]:
    """(rows, length) of the tensor the model sees: rows × padded length, or one flattened row."""
    if row.layout == pl.PACKED:
        return 1, int(row.computed_tokens)
    return int(row.rows), int(row.padded_length)


def build_batch(
    row: Any, vocab_size: int, generator: torch.Generator, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """The micro-batch of a plan row with the project's builders (right padding, or packed
    documents with restarting position ids); random token ids, real lengths and loss tokens."""
    lengths = [int(v) for v in row.example_lengths]
    loss = [int(v) for v in row.example_loss_tokens]
    if row.layout == pl.PACKED:
        return bt.packed_batch(lengths, loss, vocab_size, generator)
    return bt.padded_batch(
        lengths, loss, vocab_size, generator, pad_to=int(row.padded_length), pad_id=pad_id
    )


def gpu_busy_share(fn: Callable[[], object], device: torch.device) -> float:
    """Kernel time / wall of one call of `fn` on CUDA (device kernel rows only); NaN on CPU."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    from probes import kernels as kn

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - begin
    rows = kn.summed_rows(kn.rows_from_key_averages(prof.key_averages()), "cuda")
    return sum(r.self_time_us for r in rows) / 1e6 / wall if wall > 0 else float("nan")


class ReplayRunner:
    """Times micro-batches and optimizer steps through a StepRunner's harness, model, optimizer.

    A micro-batch is `harness.compute_loss(model, batch).backward()`, exactly as the training
    step runs it; gradients accumulate until `optimizer_step` (timed on its own) clears them.
    """

    def __init__(
        self,
        runner: Any,
        vocab_size: int,
        pad_id: int,
        seed: int,
        repeats: int = 1,
        statistic: str = "median",
    ) -> None:
        self.runner = runner
        self.statistic = statistic
        self.reduce = ft.STATISTICS[statistic]
        self.device = runner.device
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.repeats = repeats
        self.generator = torch.Generator().manual_seed(seed)

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        loss = self.runner.harness.compute_loss(self.runner.model, batch)
        loss.backward()

    def _optimizer(self) -> None:
        self.runner.optimizer.step()
        self.runner.optimizer.zero_grad(set_to_none=True)

    def device_batch(self, row: Any) -> dict[str, Any]:
        return bt.to_device(
            build_batch(row, self.vocab_size, self.generator, self.pad_id), self.device
        )

    def timed(self, fn: Callable[[], object], repeats: int) -> tuple[str, list[float]]:
        """`repeats` host wall times of `fn` between device synchronisations (timing.wall_time:
        no sampler thread beside the step, whose GIL hand-offs cost milliseconds on a loaded
        CPU); an out-of-memory error comes back as status OOM, with memory released."""
        times: list[float] = []
        out_of_memory = False
        try:
            for _ in range(repeats):
                times.append(wall_time(fn, self.device))
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        if out_of_memory:
            self.runner.optimizer.zero_grad(set_to_none=True)  # partial gradients
            release_memory(self.device)
            return OOM, []
        return OK, times

    def time_micro_batch(self, row: Any, busy: bool = False) -> dict[str, Any]:
        """One timing of the plan row's micro-batch (run_sample repeats it in later rounds)."""
        batch = self.device_batch(row)
        status, times = self.timed(lambda: self._forward_backward(batch), 1)
        share = float("nan")
        if busy and status == OK:
            share = gpu_busy_share(lambda: self._forward_backward(batch), self.device)
        return {
            "status": status,
            "time_s": float(self.reduce(times)) if times else float("nan"),
            "times_s": times,
            "timer": TIMER,
            "gpu_busy_share": share,
        }

    def warm_up(self, row: Any) -> None:
        batch = self.device_batch(row)
        self._forward_backward(batch)
        self._optimizer()
        synchronize(self.device)
        del batch

    def time_optimizer_step(self) -> float:
        return wall_time(self._optimizer, self.device)

    def time_uniform(self, rows: int, length: int, loss_share: float, warmup: int) -> float:
        """One scaling-fit point: rows × length, the data's loss share; forward + backward only
        (its gradients are cleared by an untimed optimizer step)."""
        batch = bt.to_device(
            bt.uniform_batch(rows, length, loss_share, self.vocab_size, self.generator),
            self.device,
        )
        status, times = self.timed(lambda: self._forward_backward(batch), warmup + 1)
        self._optimizer()
        if self.device.type == "cuda":  # a gc pass costs ~0.4 s with the plans in memory
            release_memory(self.device)
        return times[-1] if status == OK else float("nan")


@dataclass(frozen=True)
class ReplaySettings:
    n_strata: int
    samples_per_stratum: int
    bootstrap_resamples: int
    grad_accum: int
    seed: int = 0
    warmup: int = 1
    busy_samples_per_stratum: int = 1
    host_bound_threshold: float = HOST_BOUND_THRESHOLD


def sample_all(plans: pd.DataFrame, settings: ReplaySettings) -> pd.DataFrame:
    """Every strategy's stratified sample, interleaved in one seeded run order (so drift of the
    machine over the run spreads over all strategies instead of biasing one)."""
    rng = np.random.default_rng(settings.seed)
    parts = [
        stratified_sample(group, settings.n_strata, settings.samples_per_stratum, rng)
        for _, group in plans.groupby("strategy", sort=False)
    ]
    sample = pd.concat(parts, ignore_index=True)
    sample["run_order"] = rng.permutation(len(sample))
    return sample.sort_values("run_order").reset_index(drop=True)


def run_sample(
    runner: ReplayRunner, sample: pd.DataFrame, settings: ReplaySettings, progress: bool = False
) -> tuple[pd.DataFrame, np.ndarray]:
    """Time every sampled micro-batch (and an optimizer step after every grad_accum of them).

    With `runner.repeats` > 1 the whole sample runs that many rounds, each in a new seeded order,
    and each micro-batch keeps the runner's statistic of its rounds: a burst of load then hits one
    round of a micro-batch, not all its repeats back to back.
    """
    from tqdm import tqdm

    if len(sample) == 0:
        raise ValueError("empty sample: nothing to replay")
    largest = sample.loc[sample["computed_tokens"].idxmax()]
    for _ in range(settings.warmup):  # the peak shape first, so memory is allocated once
        runner.warm_up(largest)
    rng = np.random.default_rng(settings.seed + 7)
    rounds = max(int(runner.repeats), 1)
    times: list[list[float]] = [[] for _ in range(len(sample))]
    status = [OK] * len(sample)
    shares = [float("nan")] * len(sample)
    busy_done: dict[tuple[str, int], int] = {}
    optimizer_times = []
    rows = list(sample.itertuples())
    bar = tqdm(total=rounds * len(rows), desc="replay", disable=not progress)
    count = 0
    for round_ in range(rounds):
        order = range(len(rows)) if round_ == 0 else rng.permutation(len(rows))
        for i in order:
            row = rows[i]
            key = (row.strategy, int(row.stratum))
            busy = (
                round_ == 0
                and runner.device.type == "cuda"
                and busy_done.get(key, 0) < settings.busy_samples_per_stratum
            )
            if status[i] == OK:
                result = runner.time_micro_batch(row, busy=busy)
                status[i] = result["status"]
                times[i] += result["times_s"]
                if busy:
                    busy_done[key] = busy_done.get(key, 0) + 1
                    shares[i] = result["gpu_busy_share"]
            count += 1
            bar.update()
            if count % settings.grad_accum == 0:
                optimizer_times.append(runner.time_optimizer_step())
    bar.close()
    if count % settings.grad_accum:
        optimizer_times.append(runner.time_optimizer_step())
    steps = sample.copy()
    steps["status"] = status
    steps["times_s"] = times
    steps["time_s"] = [
        float(runner.reduce(t)) if s == OK and t else float("nan")
        for t, s in zip(times, status, strict=True)
    ]
    steps["timer"] = TIMER
    steps["gpu_busy_share"] = shares
    steps["kind"] = MICRO_BATCH
    share = steps["gpu_busy_share"]
    steps["host_bound"] = (share < settings.host_bound_threshold).where(share.notna())
    return steps, np.asarray(optimizer_times, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# The per-strategy table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitPricing:
    """The scaling fit as a diagnostic: t(T) for rows × T padded micro-batches, measured range."""

    fit: ft.QuadraticFit
    rows: int
    low: int
    high: int


def fit_priced_time(
    plan: pd.DataFrame, pricing: FitPricing | None, optimizer_s: float, optimizer_steps: int
) -> tuple[float, str]:
    """A strategy's epoch time from the fit, only where every micro-batch lies in what the fit
    measured (padded layout, ≤ its rows, padded length within its lengths); else NaN + reason."""
    if pricing is None or not pricing.fit.usable:
        return float("nan"), "no usable fit"
    if (plan["layout"] != pl.PADDED).any():
        return float("nan"), (
            "packed micro-batches (one flattened row of documents) are not a shape the fit "
            "measured (rows x T padded batches)"
        )
    lengths = plan["padded_length"].to_numpy()
    low, high = int(lengths.min()), int(lengths.max())
    if low < pricing.low or high > pricing.high:
        return float("nan"), (
            f"padded lengths {low}..{high} reach outside the fit's measured range "
            f"{pricing.low}..{pricing.high}: never extrapolated"
        )
    if int(plan["rows"].max()) > pricing.rows:
        return float("nan"), f"micro-batches of more than the fit's {pricing.rows} rows"
    fit = pricing.fit
    micro = float(np.sum(fit.a * lengths.astype(np.float64) ** 2 + fit.b * lengths + fit.c))
    note = ""
    if int(plan["rows"].min()) < pricing.rows:
        note = "; a final partial micro-batch is priced as a full one"
    return micro + optimizer_steps * optimizer_s, "priced inside the fit's measured range" + note


def strategy_table(
    plans: pd.DataFrame,
    steps: pd.DataFrame,
    optimizer_times: np.ndarray,
    settings: ReplaySettings,
    invalid: Mapping[str, str] | None = None,
    pricing: FitPricing | None = None,
    cpu_only: bool = False,
    max_seq_len: int | None = None,
) -> pd.DataFrame:
    """One row per strategy (REPLAY_COLUMNS): estimate, interval, saving, rank, fit prediction."""
    invalid = dict(invalid or {})
    summary = pl.plan_summary(plans).set_index("strategy")
    ok_steps = steps[steps["kind"] == MICRO_BATCH]
    for name, group in ok_steps.groupby("strategy"):
        if (group["status"] != OK).any():
            invalid.setdefault(
                name,
                f"{int((group['status'] != OK).sum())} sampled micro-batch(es) failed "
                f"({sorted(set(group['status']) - {OK})}): the strategy does not run as planned",
            )
    per_strategy = {
        name: strata_times(group, int(summary.loc[name, "optimizer_steps"]))
        for name, group in ok_steps.groupby("strategy", sort=False)
        if (group["status"] == OK).all()
    }
    estimates = estimate_all(
        per_strategy, optimizer_times, settings.bootstrap_resamples, settings.seed + 1
    )
    base = estimates.get(pl.BASELINE)
    optimizer_s = float(np.mean(optimizer_times)) if len(optimizer_times) else 0.0
    base_tokens = float(summary.loc[pl.BASELINE, "real_tokens_per_micro_batch"])
    fit_base, _ = (
        fit_priced_time(
            plans[plans["strategy"] == pl.BASELINE],
            pricing,
            optimizer_s,
            int(summary.loc[pl.BASELINE, "optimizer_steps"]),
        )
        if pl.BASELINE in summary.index
        else (float("nan"), "")
    )
    rows = []
    for name in summary.index:
        info = summary.loc[name]
        est = estimates.get(name)
        nan = float("nan")
        saving = (nan, nan, nan)
        if est is not None and base is not None:
            saving = saving_interval(est, base)
        part = ok_steps[ok_steps["strategy"] == name]
        busy = part["gpu_busy_share"].dropna() if "gpu_busy_share" in part else pd.Series([])
        host_bound = (
            float((busy < settings.host_bound_threshold).mean()) if len(busy) else float("nan")
        )
        fit_time, fit_reason = fit_priced_time(
            plans[plans["strategy"] == name], pricing, optimizer_s, int(info["optimizer_steps"])
        )
        fit_saving = nan
        if math.isfinite(fit_time) and math.isfinite(fit_base):
            fit_saving = 1.0 - fit_time / fit_base
        elif math.isfinite(fit_time):
            fit_reason = "the random baseline lies outside the fit's measured range"
        agrees = None
        if math.isfinite(fit_saving) and math.isfinite(saving[1]):
            agrees = bool(saving[1] <= fit_saving <= saving[2])
        steps_changed = int(info["optimizer_steps"]) != int(
            summary.loc[pl.BASELINE, "optimizer_steps"]
        )
        rows.append(
            {
                "strategy": name,
                "valid": name not in invalid,
                "invalid_reason": invalid.get(name),
                "micro_batches": int(info["micro_batches"]),
                "sampled": int(len(part)),
                "strata": int(part["stratum"].nunique()) if len(part) else 0,
                "estimated_time_s": est.time_s if est else nan,
                "ci_low_s": est.ci_low_s if est else nan,
                "ci_high_s": est.ci_high_s if est else nan,
                "saving_vs_random": saving[0],
                "saving_ci_low": saving[1],
                "saving_ci_high": saving[2],
                "optimizer_steps": int(info["optimizer_steps"]),
                "optimizer_step_s": optimizer_s,
                "tokens_per_optimizer_step": float(info["tokens_per_optimizer_step"]),
                "grad_accum": settings.grad_accum,
                "grad_accum_for_same_tokens": pl.grad_accum_for_same_tokens(
                    float(info["real_tokens_per_micro_batch"]), base_tokens, settings.grad_accum
                ),
                "real_tokens": int(info["real_tokens"]),
                "computed_tokens": int(info["computed_tokens"]),
                "gpu_busy_share": float(busy.mean()) if len(busy) else nan,
                "host_bound_share": host_bound,
                "fit_predicted_saving": fit_saving,
                "fit_predicted_time_s": fit_time,
                "fit_agrees": agrees,
                "fit_reason": fit_reason,
                "cpu_only": cpu_only,
                "max_seq_len": max_seq_len,
                "note": (
                    f"optimizer steps {int(info['optimizer_steps'])} vs random's "
                    f"{int(summary.loc[pl.BASELINE, 'optimizer_steps'])}: tokens per update "
                    "change (a hyperparameter change, not only a speed-up)"
                    if steps_changed
                    else ""
                ),
            }
        )
    table = pd.DataFrame(rows)
    ranked = table[table["valid"] & table["saving_vs_random"].notna()]
    ranks = rank_with_ties(
        ranked["strategy"].tolist(),
        ranked["saving_vs_random"].tolist(),
        ranked["saving_ci_low"].tolist(),
        ranked["saving_ci_high"].tolist(),
    )
    table["rank"] = table["strategy"].map(lambda s: ranks.get(s, (None, None))[0]).astype("Int64")
    table["tie_group"] = (
        table["strategy"].map(lambda s: ranks.get(s, (None, None))[1]).astype("Int64")
    )
    table = table.sort_values(["rank", "strategy"], na_position="last").reset_index(drop=True)
    return table[list(REPLAY_COLUMNS)]


# ---------------------------------------------------------------------------------------------
# The scaling fit from the data, with bootstrap intervals
# ---------------------------------------------------------------------------------------------


def measure_fit(
    runner: ReplayRunner,
    lengths: Sequence[int],
    rows: int,
    loss_share: float,
    repeats: int,
    seed: int,
    resamples: int,
) -> tuple[ft.BootstrapFit, pd.DataFrame]:
    """Time rows × T uniform micro-batches (forward + backward) at each length, fit with
    intervals. The lengths are visited in a new seeded order each round (one warm-up in the
    first), so a burst of load or drift spreads over lengths instead of bending the curve.
    Returns the fit and the timed points (one row per repeat)."""
    rng = np.random.default_rng(seed)
    points = []
    for repeat in range(repeats):
        for length in rng.permutation(np.asarray(lengths, dtype=np.int64)):
            seconds = runner.time_uniform(rows, int(length), loss_share, 1 if repeat == 0 else 0)
            points.append(
                {
                    "kind": FIT_POINT,
                    "padded_length": int(length),
                    "rows": rows,
                    "computed_tokens": rows * int(length),
                    "repeat": repeat,
                    "time_s": seconds,
                    "status": OK if math.isfinite(seconds) else "OOM",
                }
            )
    frame = pd.DataFrame(points)
    frame = frame[frame["status"] == OK]
    if frame.empty:
        raise ValueError(f"no fit point could be timed at {list(lengths)}")
    result = ft.fit_with_intervals(
        frame["padded_length"].to_numpy(),
        frame["time_s"].to_numpy(),
        resamples,
        seed,
        statistic=runner.statistic,
    )
    return result, frame


# ---------------------------------------------------------------------------------------------
# The positive control: a synthetic harness with a known cost
# ---------------------------------------------------------------------------------------------


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
        steps = -(-len(plan) // grad_accum)
        totals[name] = micro + steps * cost.optimizer_s
    return pd.Series(totals)


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
    from probes.harness import Harness
    from probes.training_step import StepRunner

    def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> _SyntheticLoss:
        start = time.perf_counter()
        rows, length = batch["input_ids"].shape
        return _SyntheticLoss(start + cost.micro_batch_s(int(rows), int(length)))

    harness = Harness(
        spec="probes.replay:synthetic",
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
    table = strategy_table(plans, steps, optimizer_times, settings).set_index("strategy")
    exact = exact_epoch_s(plans, cost, settings.grad_accum)
    per_strategy = {}
    passed = True
    for name in exact.index:
        exact_ratio = float(exact[name] / exact[pl.BASELINE])
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
            "passed": ok,
        }
    fit, points = measure_fit(
        runner, fit_lengths, fit_rows, 1.0, fit_repeats, settings.seed, settings.bootstrap_resamples
    )
    truth = {"a": cost.a * fit_rows, "b": cost.b * fit_rows, "c": cost.c}
    got = {"a": fit.fit.a, "b": fit.fit.b, "c": fit.fit.c}
    fit_errors = {k: abs(got[k] / truth[k] - 1.0) for k in truth}
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
