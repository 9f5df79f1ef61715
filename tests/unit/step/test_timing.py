"""probes.step.timing: repeats after warm-up, the median, and out-of-memory as a status."""

import torch

from probes.step.timing import OK, OOM, Timing, time_repeats, warmup_runs

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


def test_warmup_on_cpu_only_before_the_first_timing_and_always_on_a_gpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [warmup_runs(2, cpu, first=f) for f in (True, False)] == [2, 0]
    assert [warmup_runs(2, cuda, first=f) for f in (True, False)] == [2, 2]
