"""torch_compile priced over the run (probes.step.compile): a synthetic step with a known
compile cost per shape and a known compiled speed-up recovers the amortized saving and the
break-even step count inside their intervals; a failed compile is never recommended."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

from probes.batching import plans as pl
from probes.step import cold
from probes.step import compile as cp
from probes.step.synthetic import busy_wait

COMPILE_S, EAGER_S, COMPILED_S = 0.2, 0.02, 0.01  # known: per new shape, per micro-batch
GRAD_ACCUM = 4
RESOLUTION_S = 2e-5


class KnownCompile:
    """A step whose compiled form waits COMPILE_S the first time it meets a shape (`fragments`
    graphs built, as torch's counters would count them: a graph break splits a compile, and
    every frame compiled again after the first shape carries a recompile reason) and
    COMPILED_S a call; eager waits EAGER_S."""

    def __init__(
        self, fail_at: tuple[int, int] | None = None, dynamic_after: int = 0, fragments: int = 1
    ) -> None:
        self.graphs: set[tuple[int, int]] = set()
        self.fail_at = fail_at
        self.dynamic_after = dynamic_after  # graphs after which one graph serves every shape
        self.fragments = fragments
        self.frames: list[SimpleNamespace] = []  # torch's compilation metrics, one a frame

    def eager(self, shape: tuple[int, int]) -> None:
        busy_wait(EAGER_S)

    def compiled(self, shape: tuple[int, int]) -> None:
        if shape == self.fail_at:
            raise RuntimeError("synthetic graph break storm")
        dynamic = self.dynamic_after and len(self.graphs) >= self.dynamic_after
        if shape not in self.graphs and not dynamic:
            reason = "size mismatch" if self.graphs else None
            self.frames += [SimpleNamespace(recompile_reason=reason) for _ in range(self.fragments)]
            self.graphs.add(shape)
            busy_wait(COMPILE_S + COMPILED_S)  # one wait: one wake-up, as a steady call has
            return
        busy_wait(COMPILED_S)

    def count(self) -> cp.DynamoCounts:
        graphs = len(self.graphs) * self.fragments
        return cp.DynamoCounts(graphs, len(self.graphs) * (self.fragments - 1), tuple(self.frames))


def _plans(lengths: list[int], rows: int = 2) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "strategy": pl.BASELINE,
            "micro_batch_index": range(len(lengths)),
            "layout": pl.PADDED,
            "rows": rows,
            "padded_length": lengths,
            "computed_tokens": [rows * n for n in lengths],
        }
    )


PLAN = _plans([37, 50, 37, 64, 81, 50, 96, 113, 37, 64] * 4)  # 40 micro-batches, 6 shapes


def _measured(step: KnownCompile, measured: int) -> tuple[cp.CompileRun, int]:
    shapes = cp.plan_shapes(PLAN, pl.BASELINE)
    first = [((r, n), (r, n)) for r, n in shapes[["rows", "length"]].itertuples(index=False)]
    run = cp.measure(step.eager, step.compiled, first[:measured], repeats=5, counts=step.count)
    return run, len(shapes)


def test_the_plans_shapes_are_counted_in_the_order_the_run_meets_them():
    shapes = cp.plan_shapes(PLAN, pl.BASELINE)
    assert list(shapes["length"]) == [37, 50, 64, 81, 96, 113]
    assert list(shapes["count"]) == [12, 8, 8, 4, 4, 4] and set(shapes["rows"]) == {2}
    padded = cp.padded_to_multiple(PLAN, 64)  # the companion change: fewer shapes
    assert list(cp.plan_shapes(padded, pl.BASELINE)["length"]) == [64, 128]
    assert (padded["computed_tokens"] >= PLAN["computed_tokens"]).all()
    packed = PLAN.assign(layout=pl.PACKED)
    assert cp.padded_to_multiple(packed, 64).equals(packed)  # a flattened row has no padding
    with pytest.raises(KeyError, match="no micro-batch of strategy 'packing'"):
        cp.plan_shapes(PLAN, "packing")


def test_the_run_length_is_max_steps_where_set_else_the_epochs():
    assert cp.run_micro_batches(40, GRAD_ACCUM, num_train_epochs=2.5) == 100
    assert cp.run_micro_batches(40, GRAD_ACCUM, num_train_epochs=3, max_steps=7) == 28


def test_a_known_compile_cost_and_speed_up_are_recovered_inside_the_intervals():
    run, n_shapes = _measured(KnownCompile(), measured=4)  # 2 shapes charged from the others
    micro_batches = cp.run_micro_batches(len(PLAN), GRAD_ACCUM, num_train_epochs=100)
    priced = cp.price(run, n_shapes, micro_batches, GRAD_ACCUM)
    exact_compile = n_shapes * COMPILE_S
    exact_saving = micro_batches * (EAGER_S - COMPILED_S) - exact_compile
    exact_steps = exact_compile / (EAGER_S - COMPILED_S) / GRAD_ACCUM  # 30 steps
    assert priced["recompiles_measured"] == 3  # 4 shapes compiled: the first, 3 recompiles
    # each first call also pays a fraction of a millisecond of first-call overhead
    assert priced["compile_s"] == pytest.approx(exact_compile, rel=0.1)
    # inside the intervals, give or take the busy-wait's own resolution (RESOLUTION_S a call:
    # a loaded machine's wake-ups; the pairs' spread can be narrower than that)
    slack = micro_batches * RESOLUTION_S
    assert priced["saving_s_low"] - slack <= exact_saving <= priced["saving_s_high"] + slack
    steps_slack = exact_steps * RESOLUTION_S / (EAGER_S - COMPILED_S)
    low, high = priced["break_even_steps_low"], priced["break_even_steps_high"]
    assert low - steps_slack <= exact_steps <= high + steps_slack
    # no baseline estimate given: the share is of the eager run as timed here, and says so
    assert priced["saving_low"] < priced["saving"] < priced["saving_high"]
    assert priced["baseline_from"].startswith("eager forward + backward")
    assert priced["recommended"] is True


def test_a_run_too_short_to_pay_the_compile_is_not_recommended():
    run, n_shapes = _measured(KnownCompile(), measured=6)
    priced = cp.price(run, n_shapes, micro_batches=40, grad_accum=GRAD_ACCUM)  # one epoch
    assert priced["saving_s_high"] < 0 and priced["recommended"] is False
    assert priced["break_even_steps"] > 40 / GRAD_ACCUM


def test_a_configuration_that_fails_to_compile_is_reported_by_class_and_never_recommended():
    run, n_shapes = _measured(KnownCompile(fail_at=(2, 64)), measured=6)
    assert run.error == "RuntimeError at shape (2, 64)" and len(run.shapes) == 2
    priced = cp.price(run, n_shapes, micro_batches=10_000, grad_accum=GRAD_ACCUM)
    assert priced["recommended"] is False and "RuntimeError" in priced["why"]
    assert math.isinf(cp.break_even(1.0, -0.001, GRAD_ACCUM))


def test_once_a_graph_serves_every_shape_the_unmeasured_shapes_are_charged_no_compile():
    """torch's automatic dynamic shapes: the first shape compiles, the second recompiles with
    the length dynamic, later shapes reuse that graph; the shapes left unmeasured are charged
    the settled shapes' cost (none), not the recompile's."""
    run, n_shapes = _measured(KnownCompile(dynamic_after=2), measured=4)
    assert [s.graphs for s in run.shapes] == [1, 1, 0, 0] and run.recompiles == 1
    total, low, high = cp.compile_total(run, n_shapes)
    assert total == pytest.approx(2 * COMPILE_S, rel=0.1) and low <= 2 * COMPILE_S + 0.01


def test_recompiles_count_shapes_compiled_again_not_the_graphs_a_graph_break_splits():
    """Two graphs a shape (a graph break), 4 shapes: 8 graphs, 4 shapes compiled, 3 recompiles
    (the stored count was graphs - 1 = 7)."""
    run, n_shapes = _measured(KnownCompile(fragments=2), measured=4)
    assert run.graphs == 8 and run.shapes_compiled == 4 and run.recompiles == 3
    assert [s.recompiled_frames for s in run.shapes] == [0, 2, 2, 2]
    priced = cp.price(run, n_shapes, micro_batches=40, grad_accum=GRAD_ACCUM)
    assert priced["recompiles_measured"] == 3 and priced["graphs_measured"] == 8
    assert priced["shapes_compiled_measured"] == 4 and priced["graph_breaks_measured"] == 4
    settled, _ = _measured(KnownCompile(fragments=2, dynamic_after=2), measured=4)
    assert settled.shapes_compiled == 2 and settled.recompiles == 1 and settled.graphs == 4


def test_torchs_own_counters_tell_recompiles_from_graph_fragments():
    """A real torch.compile (the eager backend: no C++ compile) of a function with a graph
    break, over lengths 8, 9, 10: two graphs at 8, both frames recompiled at 9 (the length made
    dynamic), none at 10; one recompile, not three."""
    import torch

    def fn(x):
        y = x.sin() * 2
        print("", end="")  # a graph break: two frames, two graphs
        return (y.cos() + 1).sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager")
    batches = [((4, n), torch.randn(4, n)) for n in (8, 9, 10)]
    try:
        run = cp.measure(fn, compiled, batches, repeats=1)
    finally:
        torch._dynamo.reset()
    assert run.error is None and [s.graphs for s in run.shapes] == [2, 2, 0]
    assert [s.recompiled_frames for s in run.shapes] == [0, 2, 0]
    assert run.graphs == 4 and run.shapes_compiled == 2 and run.recompiles == 1
    assert run.shapes[0].graph_breaks >= 1


def test_the_saving_is_a_share_of_the_replays_baseline_epoch_with_its_interval():
    """Not of the eager forward + backward: a baseline epoch of known time (micro-batches and
    optimizer steps, twice the eager micro-batches here) over the run's epochs."""
    run, n_shapes = _measured(KnownCompile(), measured=6)
    epochs, epoch = (
        100,
        (2 * len(PLAN) * EAGER_S, 1.5 * len(PLAN) * EAGER_S, 3 * len(PLAN) * EAGER_S),
    )
    micro_batches = cp.run_micro_batches(len(PLAN), GRAD_ACCUM, num_train_epochs=epochs)
    base = cp.RunBaseline.of_epoch(epoch, len(PLAN), micro_batches)
    assert base.time_s == pytest.approx(epochs * epoch[0])
    priced = cp.price(run, n_shapes, micro_batches, GRAD_ACCUM, base)
    assert priced["saving"] == pytest.approx(priced["saving_s"] / (epochs * epoch[0]))
    low, high = priced["saving_s_low"], priced["saving_s_high"]
    assert priced["saving_low"] == pytest.approx(min(low / (epochs * e) for e in epoch[1:]))
    assert priced["saving_high"] == pytest.approx(max(high / (epochs * e) for e in epoch[1:]))
    assert priced["baseline_run_s_low"] == pytest.approx(epochs * epoch[1])
    assert priced["baseline_from"].startswith("the replay's baseline epoch estimate")


def test_each_compiles_own_spread_widens_the_interval():
    """Every shape measured (no charge for unmeasured ones): the interval is the compile's
    relative spread exactly, the floor unless a second cold compile was further off."""
    run, n_shapes = _measured(KnownCompile(), measured=6)
    total, low, high = cp.compile_total(run, n_shapes, spread=0.25)
    assert (low, high) == pytest.approx((0.75 * total, 1.25 * total))
    assert cp.compile_total(run, n_shapes, spread=0.0)[1:] == pytest.approx((total, total))
    assert cold.spread_of(30.0, 45.0) == cold.COMPILE_SPREAD  # 20% off their mean: the floor
    assert cold.spread_of(20.0, 40.0) == pytest.approx(1 / 3)  # wider: its own
    assert cold.spread_of(30.0, None) == cold.COMPILE_SPREAD
    spread = cold.spread_with(20.0, 40.0)
    priced = cp.price(run, n_shapes, 40, GRAD_ACCUM, spread=spread)
    assert priced["compile_s_high"] == pytest.approx(priced["compile_s"] * 4 / 3)
    assert priced["compile_spread_from"].startswith("33%: a second cold compile")
    floor = cp.price(run, n_shapes, 40, GRAD_ACCUM)
    assert floor["compile_spread"] == 0.25 and floor["compile_spread_from"] == cold.SPREAD_FLOOR


def test_a_fresh_processs_first_compile_is_measured_once_and_priced_in(monkeypatch):
    calls = iter([14.0, 1.4])  # a probe: first in its process, then again
    monkeypatch.setattr(cold, "_FIRST", [])
    first = cold.first_compile(probe=lambda: next(calls), before=lambda: False)
    assert first.excess_s == pytest.approx(12.6)
    assert (first.low_s, first.high_s) == pytest.approx((12.6 - 0.25 * 15.4, 12.6 + 0.25 * 15.4))
    assert cold.first_compile(probe=None, before=None) is first  # once a process
    monkeypatch.setattr(cold, "_FIRST", [])
    assert cold.first_compile(probe=None, before=lambda: True) is cold.NOT_FIRST
    run, n_shapes = _measured(KnownCompile(), measured=6)
    base = cp.RunBaseline(10.0, 8.0, 12.0, "known")
    without = cp.price(run, n_shapes, 40, GRAD_ACCUM, base)
    priced = cp.price(run, n_shapes, 40, GRAD_ACCUM, base, first)
    assert priced["compile_s"] == pytest.approx(without["compile_s"] + 12.6)
    assert priced["saving"] == pytest.approx(without["saving"] - 12.6 / 10.0)
    assert priced["saving_warm_process"] == pytest.approx(without["saving"])
    assert priced["first_compile"].startswith("measured") and priced["first_compile_s"] == 12.6
    assert priced["break_even_steps"] > without["break_even_steps"]


def test_fresh_compiles_gives_its_body_an_empty_cache_directory_of_its_own():
    import os

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with cp.fresh_compiles():
        inside = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert inside != before and os.listdir(inside) == []
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != inside
    assert not os.path.exists(inside)  # deleted on the way out
