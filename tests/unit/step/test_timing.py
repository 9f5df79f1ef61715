"""probes.step.timing: repeats after warm-up, the median, and out-of-memory as a status."""

import torch

from probes.step.timing import OK, OOM, ShapesRun, Timing, time_repeats

CPU = torch.device("cpu")


def test_warmup_runs_untimed_and_each_repeat_is_timed():
    calls = []
    timing = time_repeats(lambda: calls.append(1), CPU, warmup=2, repeats=3)
    assert len(calls) == 5 and timing.status == OK and len(timing.times_s) == 3
    assert timing.timer == "perf_counter" and all(t >= 0 for t in timing.times_s)


def test_median_and_spread():
    timing = Timing(OK, [3.0, 1.0, 2.0])
    assert timing.time_s == 2.0 and abs(timing.time_std_s - (2 / 3) ** 0.5) < 1e-12
    assert Timing(OK, [1.0]).time_std_s != Timing(OK, [1.0]).time_std_s  # NaN: one repeat


def test_out_of_memory_is_a_status_other_errors_propagate():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    timing = time_repeats(oom, CPU, warmup=0, repeats=2)
    assert timing.status == OOM and timing.times_s == [] and timing.error == "out of memory"

    def broken():
        raise ValueError("a bug, not memory")

    try:
        time_repeats(broken, CPU, warmup=0, repeats=1)
    except ValueError as error:
        assert "a bug" in str(error)
    else:
        raise AssertionError("a non-OOM error must propagate")


def test_a_shape_is_warmed_before_its_first_timing_only():
    shapes = ShapesRun()
    assert [shapes.warmup_runs(s, 2) for s in [(2, 64), (2, 64), (2, 32), (2, 64)]] == [2, 0, 2, 0]
