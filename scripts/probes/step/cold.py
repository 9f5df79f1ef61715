"""What a cold ``torch.compile`` costs beyond each graph's own compile, as a user's fresh
training process meets it (probes.step.compile prices it):

- ``fresh_compiles``: compiles from empty caches, as a new process on a new machine meets them;
- ``COMPILE_SPREAD`` / ``spread_of``: one compile's run-to-run spread (each graph is timed
  once), a documented floor or, where a second cold compile of one shape was timed, its own;
- ``first_compile``: a process's first compile costs more than a later one from equally empty
  caches (16-51 s on the 2-core Xeon); measured once a process with a small probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# One cold compile's run-to-run spread, a relative half-width: repeated from empty caches in one
# process on the 2-core Xeon, a graph's compile came out up to 23% off its pair's mean (62.6
# against 39.3 s; docs/evidence/cpu-xeon-amx-2026-12-05-compile, order.py), rounded up. A floor:
# a second cold compile timed (spread_of) widens it, never narrows it.
COMPILE_SPREAD = 0.25
SPREAD_FLOOR = f"floor {COMPILE_SPREAD:.0%}: measured between repeated cold compiles (evidence)"


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


def spread_of(first_s: float, again_s: float | None, floor: float = COMPILE_SPREAD) -> float:
    """A compile's relative spread: `floor`, or the deviation of one shape's two cold compiles
    (`first_s`, `again_s`, each from empty caches) from their mean where that is larger."""
    if again_s is None or first_s + again_s <= 0:
        return floor
    return max(floor, abs(first_s - again_s) / (first_s + again_s))


def spread_with(first_s: float, again_s: float) -> tuple[float, str]:
    """(spread, where from) with one shape's second cold compile timed (spread_of)."""
    spread = spread_of(first_s, again_s)
    return spread, (
        f"{spread:.0%}: a second cold compile of the first shape {again_s:.1f} s against "
        f"{first_s:.1f} s, the {COMPILE_SPREAD:.0%} floor where wider"
    )


@dataclass(frozen=True)
class FirstCompile:
    """What a process's first compile costs beyond a later one from equally empty caches
    (imports, the compile workers, the C++ toolchain's first run): a user's fresh training
    process pays it once; a process that has compiled before does not."""

    excess_s: float
    low_s: float
    high_s: float
    how: str

    @classmethod
    def of(cls, first_s: float, second_s: float, spread: float = COMPILE_SPREAD) -> FirstCompile:
        """From a probe compiled twice from empty caches, first in its process: the first's
        excess over the second, each timing's spread added to the interval."""
        excess, half = max(first_s - second_s, 0.0), spread * (first_s + second_s)
        how = (
            f"measured: a probe's first compile in this process {first_s:.1f} s against "
            f"{second_s:.1f} s for its second, each from empty caches; included in the saving"
        )
        return cls(excess, max(excess - half, 0.0), excess + half, how)


NOT_FIRST = FirstCompile(
    0.0, 0.0, 0.0, "not measured: this process had compiled before the probe; excluded"
)
_FIRST: list[FirstCompile] = []  # the process's one measurement


def tiny_compile_s() -> float:
    """One cold compile and call of a two-op function, from empty caches (seconds)."""
    import torch

    with fresh_compiles():
        fn = torch.compile(lambda x: (x * 2 + 1).sin().sum())
        begin = time.perf_counter()
        fn(torch.randn(8, 8))
        return time.perf_counter() - begin


def compiled_before() -> bool:
    """Whether torch._dynamo compiled a frame in this process (its counter; a reset keeps it)."""
    from torch._dynamo.utils import counters

    return bool(counters["frames"]["total"])


def first_compile(
    probe: Callable[[], float] = tiny_compile_s, before: Callable[[], bool] = compiled_before
) -> FirstCompile:
    """The process's first-compile excess, measured once a process with a small probe compiled
    twice before any other compile (after it, the model's compiles are all later ones: on the
    2-core Xeon the bench model's first graph took 32 s after the probe, 29 s for its repeat,
    59 s without the probe); NOT_FIRST where this process had compiled already."""
    if not _FIRST:
        _FIRST.append(NOT_FIRST if before() else FirstCompile.of(probe(), probe()))
    return _FIRST[0]


NO_FIRST = FirstCompile(0.0, 0.0, 0.0, "not measured; excluded")
