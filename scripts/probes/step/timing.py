"""Synchronised timing with warm-up and repeats, peak memory, and out-of-memory detection.

GPU work is asynchronous: a host timer around a launch measures the launch. On CUDA each repeat
is bracketed by CUDA events (and the host waits for the end event); on CPU perf_counter is exact.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

OK, OOM, ERROR = "OK", "OOM", "ERROR"
SKIPPED = "SKIPPED"


@dataclass
class Timing:
    status: str
    times_s: list[float] = field(default_factory=list)
    peak_mem_bytes: float = float("nan")
    memory_kind: str = ""
    timer: str = ""
    error: str = ""

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s) if self.times_s else float("nan")

    @property
    def time_std_s(self) -> float:
        return statistics.pstdev(self.times_s) if len(self.times_s) > 1 else float("nan")


# torch.OutOfMemoryError since 2.5; torch.cuda.OutOfMemoryError before (and as an alias after)
OOM_TYPES = tuple(
    t
    for t in (
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch.cuda, "OutOfMemoryError", None),
    )
    if t is not None
)


def is_out_of_memory(error: BaseException) -> bool:
    if OOM_TYPES and isinstance(error, OOM_TYPES):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _RssPeak:
    """Peak resident memory of this process, sampled every 20 ms (CPU has no allocator stats);
    coarse on purpose, so the sampler does not compete with the timed threads."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import psutil

            self._process = psutil.Process()
        except ImportError:  # the peak then stays NaN
            self._process = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _RssPeak:
        if self._process is not None:
            self.peak = self._process.memory_info().rss
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def value(self) -> float:
        return float(self.peak) if self._process is not None else float("nan")


@contextmanager
def peak_memory(device: torch.device) -> Iterator[Callable[[], tuple[float, str]]]:
    """Yields a function giving (peak bytes, what was measured) for the enclosed block."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: (
            float(torch.cuda.max_memory_allocated(device)),
            "cuda max_memory_allocated (weights included)",
        )
    else:
        with _RssPeak() as sampler:
            yield lambda: (
                sampler.value,
                "process RSS peak, sampled every 20 ms (weights included)",
            )


def time_repeats(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> Timing:
    """Run `fn` warmup + repeats times; time each repeat with a synchronised timer.

    An out-of-memory error is returned as status OOM (memory is released so the caller can go
    on); any other error propagates.
    """
    timer = "cuda_events" if device.type == "cuda" else "perf_counter"
    times: list[float] = []
    out_of_memory = False
    try:
        with peak_memory(device) as read_peak:
            for _ in range(warmup):
                fn()
            synchronize(device)
            for _ in range(repeats):
                if device.type == "cuda":
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1000.0)
                else:
                    begin = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - begin)
            peak, kind = read_peak()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        out_of_memory = True  # release after the except block, once the traceback is gone
    if out_of_memory:
        release_memory(device)
        return Timing(OOM, [], math.nan, "", timer, "out of memory")
    return Timing(OK, times, peak, kind, timer)


class ShapesRun:
    """The tensor shapes a process has already run: a shape's first run pays one-off costs that
    its later runs do not (on CPU oneDNN builds its kernels for the shape: measured in bfloat16
    on a CPU with bf16 units, a new shape's first forward + backward took 1.09x its next runs,
    median of 12 shapes, up to 1.20x; 1.035x in float32 on the same CPU; 0.99x in float32 on an
    AVX2 CPU; alternating between shapes already run cost nothing; on a GPU new kernels and
    allocator growth). A training epoch pays them once per distinct shape, not per micro-batch,
    so a timing that prices a micro-batch warms a shape's first run and no other."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, ...]] = set()

    def warmup_runs(self, shape: Sequence[int], configured: int = 1) -> int:
        """`configured` untimed runs before the first timing of `shape`, 0 after; records it."""
        key = tuple(int(v) for v in shape)
        new = key not in self.seen
        self.seen.add(key)
        return configured if new else 0


def wall_time(fn: Callable[[], object], device: torch.device) -> float:
    """Host wall time of `fn` between two device synchronisations."""
    synchronize(device)
    begin = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - begin
