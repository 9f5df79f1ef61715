"""``torch_compile`` as a change, priced over the run: what compiling costs on the shapes the
change's plan really meets, what it saves per micro-batch, and when it pays off.

A compiled step pays a compile (or recompile) the first time it meets a tensor shape it has no
graph for; how many it pays depends on the data (padded length x rows differs per micro-batch)
and on torch's automatic dynamic shapes (after the first recompile a dimension is marked
dynamic and later lengths often reuse that graph). So nothing here assumes a cost per shape:

- ``plan_shapes`` counts the distinct tensor shapes of a strategy's plan, in the order the run
  first meets them (``padded_to_multiple``: the same plan under the collator's
  ``pad_to_multiple_of``, fewer shapes for more padding: the companion change);
- ``measure`` runs the step compiled over those shapes in that order: each shape's first call
  (compile + run) against its steady compiled time gives its compile cost, torch's own counters
  (``torch._dynamo.utils.counters``, its compilation metrics) the graphs built, the graph
  breaks and the recompiles (shapes at which a compiled frame was compiled again: a graph break
  makes one compile several graphs, so graphs are not recompiles); eager and compiled calls of the
  same micro-batch alternate (paired) for the per-micro-batch saving. A step that fails to
  compile is recorded with the error's class and never recommended;
- ``price`` amortizes over the run's length (``run_micro_batches``: ``max_steps`` or
  ``num_train_epochs`` of the user's trainer): the saving, its 95% interval and the break-even
  step count with its interval. Shapes beyond those measured are charged the mean cost of the
  measured shapes after the first (the first pays the cold compile), with its interval; each
  compile's own run-to-run spread and a fresh process's first-compile excess (probes.step.cold)
  are added. The saving is a share of the replay's baseline over the run (``RunBaseline``: its
  epoch estimate, micro-batches + optimizer steps, with its interval), as the table's are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import plans as pl
from probes.step.cold import (  # noqa: F401  (fresh_compiles: re-exported)
    COMPILE_SPREAD,
    NO_FIRST,
    SPREAD_FLOOR,
    FirstCompile,
    fresh_compiles,
)

COMPILE_STRATEGY = "torch_compile"
PAD_MULTIPLE_PREFIX = "torch_compile_pad_to_multiple_of_"
# the config key that turns the compile pricing on (default off on CPU: a cold inductor compile
# there took 77 s and 87 s for a 4-layer model's first two graphs and 183 s for Gemma 3 270M at
# 2 x 64 on a 2-core Xeon, beyond the CPU replay's 120 s budget; docs/evidence, 2026-12-05)
ENABLE_KEY = "replay.compile"
OFF_ON_CPU = (
    "not timed: a cold torch.compile (inductor + the C++ compiler) took 1.5-3 minutes a graph "
    f"on a 2-core CPU, beyond the CPU replay's budget; set {ENABLE_KEY}: true to price it"
)


# ---------------------------------------------------------------------------------------------
# Shapes of a plan
# ---------------------------------------------------------------------------------------------


def tensor_shape(row: Any) -> tuple[int, int]:
    """(rows, length) of the tensor the model sees: rows x padded length, or one packed row."""
    if row.layout == pl.PACKED:
        return 1, int(row.computed_tokens)
    return int(row.rows), int(row.padded_length)


def plan_shapes(plans: pd.DataFrame, strategy: str) -> pd.DataFrame:
    """The distinct tensor shapes of `strategy`'s plan, in the order the run first meets them
    (micro_batch_index), with how many micro-batches have each: columns rows, length, count."""
    rows = plans[plans["strategy"] == strategy].sort_values("micro_batch_index")
    if rows.empty:
        raise KeyError(f"plans: no micro-batch of strategy {strategy!r}: build its plan first")
    shapes = pd.DataFrame([tensor_shape(r) for r in rows.itertuples()], columns=["rows", "length"])
    counted = shapes.groupby(["rows", "length"], sort=False).size().rename("count")
    return counted.reset_index()


def first_rows(plans: pd.DataFrame, strategy: str) -> list[tuple[tuple[int, int], Any]]:
    """(shape, plan row) of each distinct shape of `strategy`'s plan at its first micro-batch,
    in the order the run meets them (plan_shapes' order): the micro-batches ``measure`` runs."""
    rows = plans[plans["strategy"] == strategy].sort_values("micro_batch_index")
    out: dict[tuple[int, int], Any] = {}
    for row in rows.itertuples():
        out.setdefault(tensor_shape(row), row)
    return list(out.items())


def padded_to_multiple(plans: pd.DataFrame, multiple: int) -> pd.DataFrame:
    """`plans` as the collator's ``pad_to_multiple_of=multiple`` pads them: each padded
    micro-batch's length rounded up (computed tokens with it); packed rows are left as they are
    (a flattened row has no padding to round)."""
    if multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {multiple}")
    out = plans.copy()
    padded = out["layout"] == pl.PADDED
    length = -(-out.loc[padded, "padded_length"] // multiple) * multiple
    out.loc[padded, "padded_length"] = length
    out.loc[padded, "computed_tokens"] = out.loc[padded, "rows"] * length
    return out


def run_micro_batches(
    micro_batches_per_epoch: int,
    grad_accum: int,
    num_train_epochs: float = 1.0,
    max_steps: int = -1,
) -> int:
    """Micro-batches the user's run trains: ``max_steps`` optimizer steps where set (> 0, as
    the Trainer reads it), else ``num_train_epochs`` epochs of the plan."""
    if max_steps and max_steps > 0:
        return int(max_steps) * int(grad_accum)
    return int(math.ceil(float(num_train_epochs) * int(micro_batches_per_epoch)))


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamoCounts:
    """torch._dynamo's own counters at one moment: graphs built (``counters["stats"]
    ["unique_graphs"]``, every fragment a graph break splits a compile into), graph breaks
    (``counters["graph_break"]``) and the frames compiled so far (its compilation metrics, each
    with a ``recompile_reason`` where the frame had been compiled before for another shape)."""

    graphs: int
    graph_breaks: int
    frames: tuple[Any, ...] = ()  # held, so ``since`` tells the new ones by identity

    def since(self, before: DynamoCounts) -> tuple[int, int, int]:
        """(graphs, graph breaks, frames recompiled) between `before` and this moment."""
        new = [f for f in self.frames if not any(f is b for b in before.frames)]
        recompiled = sum(1 for f in new if getattr(f, "recompile_reason", None))
        return self.graphs - before.graphs, self.graph_breaks - before.graph_breaks, recompiled


def dynamo_counts() -> DynamoCounts:
    """torch._dynamo's counters now (DynamoCounts)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    return DynamoCounts(
        int(counters["stats"]["unique_graphs"]),
        int(sum(counters["graph_break"].values())),
        tuple(get_compilation_metrics()),
    )


@dataclass
class ShapeCompile:
    shape: tuple[int, int]
    first_s: float  # the shape's first compiled call: compile (if any) + run
    steady_s: float  # its compiled call once compiled (median)
    graphs: int  # graphs torch built at this shape (0: an existing graph served it)
    graph_breaks: int = 0  # graph breaks torch met at this shape
    recompiled_frames: int = 0  # frames torch recompiled here (a recompile reason recorded)

    @property
    def compile_s(self) -> float:
        return max(self.first_s - self.steady_s, 0.0)


@dataclass
class CompileRun:
    """What compiling the step cost and saved on the shapes measured (``measure``)."""

    shapes: list[ShapeCompile] = field(default_factory=list)
    eager_s: list[float] = field(default_factory=list)  # paired with compiled_s, same batch
    compiled_s: list[float] = field(default_factory=list)
    error: str | None = None  # the failure's class and where ("compile at shape (2, 96)")

    @property
    def graphs(self) -> int:
        """Graphs torch built (fragments included: a graph break splits a compile in two)."""
        return sum(s.graphs for s in self.shapes)

    @property
    def shapes_compiled(self) -> int:
        """Distinct shapes that made torch compile (built a graph); the others reused one."""
        return sum(1 for s in self.shapes if s.graphs > 0)

    @property
    def recompiles(self) -> int:
        """Shapes at which the run stopped to recompile: a graph built for frames torch had
        compiled before (its recompile reason recorded), whatever the fragments' count."""
        return sum(1 for s in self.shapes if s.graphs > 0 and s.recompiled_frames > 0)


def _timed(fn: Callable[[Any], Any], batch: Any) -> float:
    begin = time.perf_counter()
    fn(batch)
    return time.perf_counter() - begin


def measure(
    eager: Callable[[Any], Any],
    compiled: Callable[[Any], Any],
    batches: Sequence[tuple[tuple[int, int], Any]],
    repeats: int = 3,
    counts: Callable[[], DynamoCounts] = dynamo_counts,
) -> CompileRun:
    """Each (shape, batch) in the order the run meets them: the compiled step's first call
    (compile + run), then `repeats` eager / compiled pairs of the same batch. `eager` and
    `compiled` run one micro-batch (forward + backward; they synchronise the device). A
    failure ends the run with its class recorded: that configuration is never recommended."""
    run = CompileRun()
    for shape, batch in batches:
        before = counts()
        try:
            first = _timed(compiled, batch)
            eager(batch)  # its first run at a shape warms too (the replay never times one)
            pairs = [(_timed(eager, batch), _timed(compiled, batch)) for _ in range(repeats)]
        except Exception as error:  # the answer for this configuration, not a crash
            run.error = f"{type(error).__name__} at shape {shape}"
            return run
        steady = float(np.median([c for _, c in pairs]))
        run.shapes.append(ShapeCompile(shape, first, steady, *counts().since(before)))
        run.eager_s += [e for e, _ in pairs]
        run.compiled_s += [c for _, c in pairs]
    return run


def compile_again(compiled: Callable[[Any], Any], shape: ShapeCompile, batch: Any) -> float:
    """Seconds a second cold compile of a measured `shape` takes (`compiled` freshly wrapped, under
    fresh_compiles): its first call less the shape's steady compiled call."""
    return max(_timed(compiled, batch) - shape.steady_s, 0.0)


def step_functions(
    runner: Any, backend: str = "inductor"
) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """(eager, compiled) micro-batch calls of a step runner (the harness's StepRunner or the
    user's TrainerStep): its own ``forward_backward`` with its model, or with that model under
    ``torch.compile`` (what ``TrainingArguments(torch_compile=True)`` wraps), synchronised and
    its gradients dropped after each call (no accumulation across the pairs)."""
    import torch

    from probes.step.timing import synchronize

    model = runner.model
    compiled_model = torch.compile(model, backend=backend)

    def call(module: Any, batch: Any) -> None:
        runner.model = module
        try:
            runner.forward_backward(dict(batch))
            synchronize(runner.device)
        finally:
            runner.model = model
            runner.zero_grad()

    return (lambda batch: call(model, batch)), (lambda batch: call(compiled_model, batch))


# ---------------------------------------------------------------------------------------------
# Pricing over the run
# ---------------------------------------------------------------------------------------------


def _t(n: int) -> float:
    """Student t's two-sided 95% quantile for a mean of `n` values (the replay's own)."""
    from probes.replay.greg import t_quantile_975

    return t_quantile_975(max(n - 1, 1))


def compile_total(
    run: CompileRun, n_shapes: int, spread: float = COMPILE_SPREAD
) -> tuple[float, float, float]:
    """Compile seconds over all `n_shapes` of the plan (estimate, low, high): the measured
    shapes' own, and each unmeasured shape charged the mean of the measured ones after the last
    that built a graph (torch's automatic dynamic shapes: once a dimension is dynamic, later
    lengths reuse that graph; measured on the tiny bench model, shapes 3-5 built none), else of
    those after the first (the cold compile is paid once), with a t-interval on that mean; the
    interval then widened by a compile's own run-to-run `spread` (each graph is timed once)."""
    costs = np.array([s.compile_s for s in run.shapes])
    if costs.size == 0:
        raise ValueError("no shape was measured: nothing to price")
    rest = max(n_shapes - costs.size, 0)
    built = [i for i, s in enumerate(run.shapes) if s.graphs > 0]
    settled = costs[built[-1] + 1 :] if built else costs
    tail = settled if settled.size > 1 else (costs[1:] if costs.size > 1 else costs)
    mean = float(tail.mean())
    half = _t(tail.size) * float(tail.std(ddof=1)) / math.sqrt(tail.size) if tail.size > 1 else 0.0
    measured = float(costs.sum())
    return (
        measured + rest * mean,
        (measured + rest * max(mean - half, 0.0)) * (1.0 - spread),
        (measured + rest * (mean + half)) * (1.0 + spread),
    )


def per_micro_batch_saving(run: CompileRun) -> tuple[float, float, float]:
    """Median eager - compiled seconds per micro-batch over the pairs (paired_saving)."""
    return paired_saving(run.eager_s, run.compiled_s)


def paired_saving(base: Sequence[float], change: Sequence[float]) -> tuple[float, float, float]:
    """Median base - change seconds over paired timings, with its distribution-free 95%
    interval (the sign test's order statistics): a pair the machine preempted is one outlier,
    which would drag a mean and its t-interval (a busy-wait step of known cost came out 1% off
    its truth, outside the t-interval, while a compiler ran beside it)."""
    diff = np.sort(np.asarray(base, dtype=float) - np.asarray(change, dtype=float))
    if diff.size < 2:
        raise ValueError("fewer than 2 pairs: no interval")
    k = sign_test_rank(diff.size)
    return float(np.median(diff)), float(diff[k]), float(diff[diff.size - 1 - k])


def sign_test_rank(n: int) -> int:
    """The 0-based rank j of the lower bound of the median's 95% interval over n sorted values
    (the upper bound's is n - 1 - j): the largest j with P(Binomial(n, 1/2) <= j) <= 0.025, so
    the interval covers with 1 - 2 P(X <= j) >= 95%; 0 (the extremes) where n is too small."""
    rank, tail = 0, 0.0
    for j in range(n):
        tail += math.comb(n, j) / 2**n
        if tail > 0.025:
            break
        rank = j
    return rank


def break_even(compile_s: float, saving_s: float, grad_accum: int) -> float:
    """Optimizer steps until the saving has paid the compile (inf where it never does)."""
    if saving_s <= 0:
        return math.inf
    return compile_s / saving_s / grad_accum


@dataclass(frozen=True)
class RunBaseline:
    """The baseline's time over the run (seconds, 95% interval): what the saving is a share of,
    and where it comes from."""

    time_s: float
    low_s: float
    high_s: float
    source: str

    @classmethod
    def of_epoch(
        cls, epoch: tuple[float, float, float], plan_micro_batches: int, micro_batches: int
    ) -> RunBaseline:
        """The replay's baseline epoch estimate (the table's: micro-batches + optimizer steps)
        over the run's `micro_batches` (its epochs: `plan_micro_batches` an epoch)."""
        scale = micro_batches / plan_micro_batches
        source = "the replay's baseline epoch estimate (micro-batches + optimizer steps) x epochs"
        return cls(epoch[0] * scale, epoch[1] * scale, epoch[2] * scale, source)

    @classmethod
    def eager(cls, run: CompileRun, micro_batches: int) -> RunBaseline:
        """Where the table has no baseline estimate: the measured eager micro-batches only."""
        time_s = micro_batches * float(np.mean(run.eager_s))
        return cls(time_s, time_s, time_s, "eager forward + backward of the measured shapes only")


def share(saving: tuple[float, float, float], base: RunBaseline) -> tuple[float, float, float]:
    """A saving in seconds (estimate, low, high) as a share of `base`, each end over the end of
    the baseline's interval that makes it widest (both intervals carried, conservatively)."""
    s, low, high = saving
    ends = (base.low_s, base.high_s)
    return s / base.time_s, min(low / b for b in ends), max(high / b for b in ends)


def price(
    run: CompileRun,
    n_shapes: int,
    micro_batches: int,
    grad_accum: int,
    baseline: RunBaseline | None = None,
    first: FirstCompile = NO_FIRST,
    spread: tuple[float, str] = (COMPILE_SPREAD, SPREAD_FLOOR),
) -> dict[str, Any]:
    """The change over the run, as a user's fresh training process pays it: saving in seconds
    and as a share of `baseline` (the replay's baseline over the run; the eager micro-batches
    where not given), each with its 95% interval (a compile's relative `spread`, with where it
    comes from, included), break-even steps with theirs, and whether it is recommended (it
    compiled, and its saving's interval lies above zero); ``saving_warm_process`` without the
    process's `first` compile's excess. A failed compile is priced as not recommended."""
    record: dict[str, Any] = {
        "shapes": int(n_shapes),
        "shapes_measured": len(run.shapes),
        "shapes_compiled_measured": run.shapes_compiled,
        "recompiles_measured": run.recompiles,
        "graphs_measured": run.graphs,
        "graph_breaks_measured": sum(s.graph_breaks for s in run.shapes),
        "run_micro_batches": int(micro_batches),
        "error": run.error,
    }
    if run.error is not None:
        return {**record, "recommended": False, "why": f"failed to compile: {run.error}"}
    base = baseline or RunBaseline.eager(run, micro_batches)
    later = compile_total(run, n_shapes, spread[0])
    c = (later[0] + first.excess_s, later[1] + first.low_s, later[2] + first.high_s)
    d, d_low, d_high = per_micro_batch_saving(run)
    warm = (micro_batches * d - later[0], micro_batches * d_low - later[2],
            micro_batches * d_high - later[1])  # fmt: skip
    saving = (micro_batches * d - c[0], micro_batches * d_low - c[2], micro_batches * d_high - c[1])
    steps = (
        break_even(c[0], d, grad_accum),
        break_even(c[1], d_high, grad_accum),
        break_even(c[2], d_low, grad_accum),
    )
    return {
        **record,
        **_triple("compile_s", c),
        **_triple("first_compile_s", (first.excess_s, first.low_s, first.high_s)),
        "first_compile": first.how,
        "compile_spread": spread[0],
        "compile_spread_from": spread[1],
        "micro_batch_saving_s": d,
        **_triple("saving_s", saving),
        **_triple("baseline_run_s", (base.time_s, base.low_s, base.high_s)),
        "baseline_from": base.source,
        **_triple("saving", share(saving, base)),
        **_triple("saving_warm_process", share(warm, base)),
        **_triple("break_even_steps", steps),
        "recommended": bool(saving[1] > 0),
        "why": None,
    }


def _triple(name: str, values: tuple[float, float, float]) -> dict[str, float]:
    """{name, name_low, name_high}: an estimate and its 95% interval as record columns."""
    return {name: values[0], f"{name}_low": values[1], f"{name}_high": values[2]}
