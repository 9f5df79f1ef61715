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
  (``torch._dynamo.utils.counters``) the graphs and recompiles; eager and compiled calls of the
  same micro-batch alternate (paired) for the per-micro-batch saving. A step that fails to
  compile is recorded with the error's class and never recommended;
- ``price`` amortizes over the run's length (``run_micro_batches``: ``max_steps`` or
  ``num_train_epochs`` of the user's trainer): the saving, its 95% interval and the break-even
  step count with its interval. Shapes beyond those measured are charged the mean cost of the
  measured shapes after the first (the first pays the cold compile), with its interval.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import plans as pl

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


def dynamo_graphs() -> int:
    """Graphs torch.compile has built so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class ShapeCompile:
    shape: tuple[int, int]
    first_s: float  # the shape's first compiled call: compile (if any) + run
    steady_s: float  # its compiled call once compiled (median)
    graphs: int  # graphs torch built at this shape (0: an existing graph served it)

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
    def recompiles(self) -> int:
        """Graphs built after the first (torch's counter): each a recompile."""
        return max(sum(s.graphs for s in self.shapes) - 1, 0)


def _timed(fn: Callable[[Any], Any], batch: Any) -> float:
    begin = time.perf_counter()
    fn(batch)
    return time.perf_counter() - begin


def measure(
    eager: Callable[[Any], Any],
    compiled: Callable[[Any], Any],
    batches: Sequence[tuple[tuple[int, int], Any]],
    repeats: int = 3,
    graphs: Callable[[], int] = dynamo_graphs,
) -> CompileRun:
    """Each (shape, batch) in the order the run meets them: the compiled step's first call
    (compile + run), then `repeats` eager / compiled pairs of the same batch. `eager` and
    `compiled` run one micro-batch (forward + backward; they synchronise the device). A
    failure ends the run with its class recorded: that configuration is never recommended."""
    run = CompileRun()
    for shape, batch in batches:
        before = graphs()
        try:
            first = _timed(compiled, batch)
            eager(batch)  # its first run at a shape warms too (the replay never times one)
            pairs = [(_timed(eager, batch), _timed(compiled, batch)) for _ in range(repeats)]
        except Exception as error:  # the answer for this configuration, not a crash
            run.error = f"{type(error).__name__} at shape {shape}"
            return run
        steady = float(np.median([c for _, c in pairs]))
        run.shapes.append(ShapeCompile(shape, first, steady, graphs() - before))
        run.eager_s += [e for e, _ in pairs]
        run.compiled_s += [c for _, c in pairs]
    return run


@contextmanager
def fresh_compiles() -> Iterator[None]:
    """Compiles as a new process on a new machine meets them: torch._dynamo's graphs dropped, and
    inductor's caches (FX graphs, generated C++ kernels; in memory and on disk) emptied for the
    body (``torch._inductor.utils.fresh_cache``), so each graph built in it pays its whole
    compile. Without it a second configuration reuses the first's kernels where they match (a
    warm graph took 6-9 s against 77-87 s cold on a 2-core Xeon: docs/evidence)."""
    import torch
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    try:
        with fresh_cache():
            yield
    finally:
        torch._dynamo.reset()


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


def compile_total(run: CompileRun, n_shapes: int) -> tuple[float, float, float]:
    """Compile seconds over all `n_shapes` of the plan (estimate, low, high): the measured
    shapes' own, and each unmeasured shape charged the mean of the measured ones after the last
    that built a graph (torch's automatic dynamic shapes: once a dimension is dynamic, later
    lengths reuse that graph; measured on the tiny bench model, shapes 3-5 built none), else of
    those after the first (the cold compile is paid once), with a t-interval on that mean."""
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
        measured + rest * max(mean - half, 0.0),
        measured + rest * (mean + half),
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


def price(run: CompileRun, n_shapes: int, micro_batches: int, grad_accum: int) -> dict[str, Any]:
    """The change over the run: saving in seconds and as a share of the eager run, each with its
    95% interval, break-even steps with theirs, and whether it is recommended (it compiled, and
    its saving's interval lies above zero). A failed compile is priced as not recommended."""
    record: dict[str, Any] = {
        "shapes": int(n_shapes),
        "shapes_measured": len(run.shapes),
        "recompiles_measured": run.recompiles,
        "run_micro_batches": int(micro_batches),
        "error": run.error,
    }
    if run.error is not None:
        return {**record, "recommended": False, "why": f"failed to compile: {run.error}"}
    c, c_low, c_high = compile_total(run, n_shapes)
    d, d_low, d_high = per_micro_batch_saving(run)
    eager_run = micro_batches * float(np.mean(run.eager_s))
    saving = (micro_batches * d - c, micro_batches * d_low - c_high, micro_batches * d_high - c_low)
    steps = (
        break_even(c, d, grad_accum),
        break_even(c_low, d_high, grad_accum),
        break_even(c_high, d_low, grad_accum),
    )
    return {
        **record,
        "compile_s": c,
        "compile_s_low": c_low,
        "compile_s_high": c_high,
        "micro_batch_saving_s": d,
        "saving_s": saving[0],
        "saving_s_low": saving[1],
        "saving_s_high": saving[2],
        "saving": saving[0] / eager_run,
        "saving_low": saving[1] / eager_run,
        "saving_high": saving[2] / eager_run,
        "break_even_steps": steps[0],
        "break_even_steps_low": steps[1],
        "break_even_steps_high": steps[2],
        "recommended": bool(saving[1] > 0),
        "why": None,
    }
