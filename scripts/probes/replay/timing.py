"""Replay's timing loop: what is measured.

Forward + backward through the harness's own ``compute_loss`` for each sampled micro-batch
(shapes, padding side, packing boundaries and loss-token counts are the plan's real ones; token
values are random), and the optimizer step on its own; and uniform micro-batches at each length
for the scaling fit (``measure_fit``).
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.config import schema_default
from probes.replay.reference import Reference, in_reference_seconds
from probes.step import batches as bt
from probes.step import fit as ft
from probes.step.threads import available_cores
from probes.step.timing import (
    OK,
    OOM,
    ShapesRun,
    is_out_of_memory,
    release_memory,
    synchronize,
    wall_time,
)

MICRO_BATCH, OPTIMIZER_STEP, FIT_POINT = "micro_batch", "optimizer_step", "fit_point"
TIMER = "host wall between device synchronisations (probes.step.timing.wall_time)"


# ---------------------------------------------------------------------------------------------
# Shapes, batches and the runner
# ---------------------------------------------------------------------------------------------


build_batch = bt.plan_batch  # the harness path's micro-batch of a plan row


def gpu_busy_share(fn: Callable[[], object], device: torch.device) -> float:
    """Kernel time / wall of one call of `fn` on CUDA (device kernel rows only); NaN on CPU."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    from probes.step import kernels as kn

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - begin
    rows = kn.summed_rows(kn.rows_from_key_averages(prof.key_averages()), "cuda")
    return sum(r.self_time_us for r in rows) / 1e6 / wall if wall > 0 else float("nan")


class ReplayRunner:
    """Times micro-batches and optimizer steps through a step (the harness's StepRunner or the
    user's TrainerStep, probes.step): a micro-batch is the step's own ``forward_backward``,
    exactly as training runs it; gradients accumulate until ``optimizer_step`` (timed on its
    own) clears them."""

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
        self.shapes = ShapesRun()  # a shape's first run is warmed, never timed
        self.switch: Any = None  # probes.step.changes.StepSwitch, where changes are priced
        self.reference: Reference | None = None  # timed beside the units (Reference)

    def configure(self, strategy: str | None) -> Any:
        """Set the step for `strategy` (its step-level change, else the base); returns it."""
        return self.switch.set(strategy) if self.switch is not None else None

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        self.runner.forward_backward(batch)

    def _optimizer(self) -> None:
        self.runner.optimizer_step()

    def device_batch(self, row: Any) -> dict[str, Any]:
        return self.runner.plan_batch(row, self.vocab_size, self.generator, self.pad_id)

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
            self.runner.zero_grad()  # partial gradients
            release_memory(self.device)
            return OOM, []
        return OK, times

    def micro_batch_call(self, row: Any, batch: dict[str, Any]) -> Callable[[], None]:
        """What one timed micro-batch runs: the step's forward + backward on `batch` (`row`'s);
        where the trainer's own loop collates every micro-batch in its process (a TrainerStep at
        dataloader_num_workers 0), the collation of `row` too, as that loop does: left out, the
        baseline's epoch came out ~2 ms a micro-batch short of the Trainer's on the bench, and
        packing (fewer micro-batches) realized 6 pp over its promise."""
        if self.runner.collates_in_loop:
            return lambda: self._forward_backward(self.device_batch(row))
        return lambda: self._forward_backward(batch)

    def time_micro_batch(self, row: Any, busy: bool = False) -> dict[str, Any]:
        """One timing of the plan row's micro-batch, its shape warmed before (run_sample:
        warm_new_shapes; it repeats the timing in later rounds)."""
        config = self.configure(getattr(row, "strategy", None))
        batch = self.device_batch(row)
        self.shapes.warmup_runs((hash(config), *batch["input_ids"].shape))  # it has run now
        status, times = self.timed(self.micro_batch_call(row, batch), 1)
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

    def warm_new_shapes(self, sample: pd.DataFrame) -> int:
        """Each (step configuration, shape) of `sample` not run yet, once, untimed, before any
        of it is timed; returns how many. Warmed inline instead, a new shape's timing ran right
        after a run of itself while a shape met before ran after another strategy's unit of the
        interleaved order: on the trainer bench padding-free with eager attention, whose
        flattened rows are nearly all new shapes, gained 1-3 pp on random that way. Now every
        timed unit runs after another unit, whatever its strategy."""
        warmed = 0
        for row in sample.itertuples():
            config = self.configure(getattr(row, "strategy", None))
            batch = self.device_batch(row)
            if self.shapes.warmup_runs((hash(config), *batch["input_ids"].shape)):
                # through timed: a shape out of memory is released here and timed as OOM after
                self.timed(lambda batch=batch: self._forward_backward(batch), 1)
                warmed += 1
        if warmed:
            self._optimizer()  # the warm-ups' gradients, cleared
            synchronize(self.device)
        return warmed

    def warm_up(self, row: Any) -> None:
        config = self.configure(getattr(row, "strategy", None))
        batch = self.device_batch(row)
        self.shapes.warmup_runs((hash(config), *batch["input_ids"].shape))  # its warm-up
        self._forward_backward(batch)
        self._optimizer()
        synchronize(self.device)
        del batch

    def time_optimizer_step(self) -> float:
        return wall_time(self._optimizer, self.device)

    def time_reference(self) -> float:
        """One timing of the reference micro-batch (the base step's; its shape ran already)."""
        assert self.reference is not None
        row = self.reference.row
        self.configure(getattr(row, "strategy", None))
        status, times = self.timed(self.micro_batch_call(row, self.device_batch(row)), 1)
        return times[0] if status == OK and times else float("nan")

    def time_uniform(self, rows: int, length: int, loss_share: float) -> float:
        """One scaling-fit point: rows × length, the data's loss share; forward + backward only
        (its gradients are cleared by an untimed optimizer step); a new shape warmed first."""
        config = self.configure(None)  # the scaling fit is the base step's
        batch = bt.to_device(
            bt.uniform_batch(rows, length, loss_share, self.vocab_size, self.generator),
            self.device,
        )
        warmup = self.shapes.warmup_runs((hash(config), *batch["input_ids"].shape))
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
    # A GPU step whose kernels keep the card busy for less than this share of its wall time is
    # host-bound (launch overhead, not compute); default: the schema's replay.host_bound_threshold
    host_bound_threshold: float = field(
        default_factory=lambda: float(schema_default("replay", "host_bound_threshold"))
    )
    # a change is decided when its saving interval excludes 0 or lies within ±decide_within,
    # and is at most max_width wide (greg.is_open); defaults: the schema's
    decide_within: float = field(
        default_factory=lambda: float(schema_default("replay", "decide_within"))
    )
    max_width: float = field(default_factory=lambda: float(schema_default("replay", "max_width")))


def run_sample(
    runner: ReplayRunner, sample: pd.DataFrame, settings: ReplaySettings, progress: bool = False
) -> tuple[pd.DataFrame, np.ndarray]:
    """Time every sampled micro-batch (and an optimizer step after every grad_accum of them).

    With `runner.repeats` > 1 the whole sample runs that many rounds, each in a new seeded order,
    and each micro-batch keeps the runner's statistic of its rounds: a burst of load then hits one
    round of a micro-batch, not all its repeats back to back.
    """

    if len(sample) == 0:
        raise ValueError("empty sample: nothing to replay")
    largest = sample.loc[sample["computed_tokens"].idxmax()]
    for _ in range(settings.warmup):  # the peak shape first, so memory is allocated once
        runner.warm_up(largest)
    runner.warm_new_shapes(sample)
    rng = np.random.default_rng(settings.seed + 7)
    rounds = max(int(runner.repeats), 1)
    gc.collect()  # a collection inside a timed step would be the interpreter's cost, not the step's
    gc.disable()
    try:
        steps, optimizer_times = _timed_rounds(runner, sample, settings, rounds, rng, progress)
    finally:
        gc.enable()
    return steps, optimizer_times


def _timed_rounds(
    runner: ReplayRunner,
    sample: pd.DataFrame,
    settings: ReplaySettings,
    rounds: int,
    rng: np.random.Generator,
    progress: bool,
) -> tuple[pd.DataFrame, np.ndarray]:
    from tqdm import tqdm

    times: list[list[float]] = [[] for _ in range(len(sample))]
    places: list[list[int]] = [[] for _ in range(len(sample))]
    marks: list[tuple[int, float]] = []  # (place, seconds) of each reference timing
    status = [OK] * len(sample)
    shares = [float("nan")] * len(sample)
    busy_done: dict[tuple[str, int], int] = {}
    optimizer_times = []
    rows = list(sample.itertuples())
    reference = getattr(runner, "reference", None)
    reference = reference if reference is not None and reference.every > 0 else None
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
            if reference is not None and count % reference.every == 0:
                marks.append((count, runner.time_reference()))
            if status[i] == OK:
                result = runner.time_micro_batch(row, busy=busy)
                status[i] = result["status"]
                times[i] += result["times_s"]
                places[i] += [count] * len(result["times_s"])
                if busy:
                    busy_done[key] = busy_done.get(key, 0) + 1
                    shares[i] = result["gpu_busy_share"]
            count += 1
            bar.update()
            if count % settings.grad_accum == 0:
                optimizer_times.append(runner.time_optimizer_step())
    bar.close()
    if reference is not None:
        marks.append((count, runner.time_reference()))
    if count % settings.grad_accum:
        optimizer_times.append(runner.time_optimizer_step())
    steps = sample.copy()
    steps["status"] = status
    steps["raw_times_s"] = times
    steps["times_s"] = priced = in_reference_seconds(times, places, marks, reference)
    steps["time_s"] = [
        float(runner.reduce(t)) if s == OK and t else float("nan")
        for t, s in zip(priced, status, strict=True)
    ]
    steps["timer"] = TIMER
    steps["gpu_busy_share"] = shares
    steps["kind"] = MICRO_BATCH
    share = steps["gpu_busy_share"]
    steps["host_bound"] = (share < settings.host_bound_threshold).where(share.notna())
    return steps, np.asarray(optimizer_times, dtype=np.float64)


def without_one_outlier(times: np.ndarray) -> tuple[np.ndarray, float | None]:
    """The instrument's timings less the one farthest from their median where it lies over
    OUTLIER_SPREADS robust spreads (1.4826 × MAD) and over 5% from it, as the replay's outlier
    rule treats a unit (one preempted timing of five, 0.50 s against 0.33 s, made a quiet run's
    CV 20% instead of 0.6%, its coverage control uninformative and its report call the machine
    busy); (kept, the timing left out or None). Under five timings, all kept."""
    from probes.replay.outliers import OUTLIER_SPREADS

    if times.size < 5:
        return times, None
    median = float(np.median(times))
    spread = 1.4826 * float(np.median(np.abs(times - median)))
    far = int(np.argmax(np.abs(times - median)))
    if abs(times[far] - median) <= max(OUTLIER_SPREADS * spread, 0.05 * median):
        return times, None
    return np.delete(times, far), float(times[far])


def measure_instrument(runner: ReplayRunner, row: Any, repeats: int, warmup: int) -> dict:
    """The instrument's own spread: `repeats` timings of one identical micro-batch (same shape,
    loss tokens and token ids) after `warmup` untimed ones when its shape has not run yet
    (probes.step.timing.ShapesRun), with gc off as in the replay loop. CV = sample standard
    deviation / mean, one preempted timing left out (without_one_outlier); what was done to
    reduce it is recorded beside it."""
    config = runner.configure(getattr(row, "strategy", None))
    batch = runner.device_batch(row)
    warmup = runner.shapes.warmup_runs((hash(config), *batch["input_ids"].shape), warmup)
    gc.collect()
    gc.disable()
    try:
        status, times = runner.timed(runner.micro_batch_call(row, batch), warmup + repeats)
        runner._optimizer()
    finally:
        gc.enable()
    warmup_times, times = times[:warmup], times[warmup:]
    arr = np.asarray(times, dtype=np.float64)
    kept, left_out = without_one_outlier(arr)
    ok = status == OK and kept.size >= 2 and float(kept.mean()) > 0
    return {
        "status": status,
        "warmup_times_s": [float(v) for v in warmup_times],
        "cv": float(kept.std(ddof=1) / kept.mean()) if ok else float("nan"),
        "repeats": int(kept.size),
        "times_s": [float(v) for v in arr],
        "left_out_s": left_out,
        "mean_s": float(kept.mean()) if kept.size else float("nan"),
        "micro_batch": {
            "strategy": str(row.strategy),
            "layout": str(row.layout),
            "rows": int(row.rows),
            "padded_length": int(row.padded_length),
            "loss_tokens": int(row.loss_tokens),
        },
        "done": {
            "warmup": int(warmup),
            "gc": "collected before, disabled during every timed loop",
            "threads": int(torch.get_num_threads()) if runner.device.type == "cpu" else None,
            "cpu_affinity_cores": available_cores(),
            "pinning": "not pinned (the process's CPU affinity as given)",
            "timer": TIMER,
            "collation": (
                "timed with each micro-batch, as the trainer's loop collates it"
                if runner.runner.collates_in_loop
                else "outside the timer"
            ),
        },
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def instrument_unit(instrument: Mapping[str, Any]) -> tuple[float, float]:
    """(seconds, tokens) of one new-shape micro-batch: the instrument's mean micro-batch and its
    shape's first run, and its computed + loss tokens ((0, 1) when the instrument did not time:
    nothing is sized by it)."""
    mean = float(instrument.get("mean_s", float("nan")))
    batch = instrument.get("micro_batch") or {}
    computed = batch.get("rows", 0) * batch.get("padded_length", 0)
    tokens = float(computed + batch.get("loss_tokens", 0))
    if not (math.isfinite(mean) and mean > 0 and tokens > 0):
        return 0.0, 1.0
    # a new shape in the replay is warmed once (ShapesRun's default), whatever the instrument's
    # own warm-up count: its first run, else one more mean where its shape had run already
    first = (instrument.get("warmup_times_s") or [mean])[0]
    return mean + float(first), tokens


def median_row(plans: pd.DataFrame, strategy: str) -> Any:
    """The plan row of `strategy` at its median computed tokens (the instrument's micro-batch)."""
    plan = plans[plans["strategy"] == strategy].sort_values(["computed_tokens", "loss_tokens"])
    return next(plan.iloc[[len(plan) // 2]].itertuples())


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
    intervals. The lengths are visited in a new seeded order each round (each length's first
    run warmed: probes.step.timing.ShapesRun), so a burst of load or drift spreads over lengths
    instead of bending the curve.
    Returns the fit and the timed points (one row per repeat)."""
    rng = np.random.default_rng(seed)
    points = []
    for repeat in range(repeats):
        for length in rng.permutation(np.asarray(lengths, dtype=np.int64)):
            seconds = runner.time_uniform(rows, int(length), loss_share)
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
