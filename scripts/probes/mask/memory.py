"""Keep freed large blocks in the heap while the mask gate runs (glibc only; a no-op elsewhere).

The gate builds and drops dense (B, 1, T, T) masks: at 2 x 16,384 each is 512 MiB, and building
one takes several temporaries of that size. glibc serves every block above its mmap threshold
(at most 32 MiB) with a fresh mmap and gives it back with munmap when freed, so the next mask
faults in and zeroes every page again: measured at 2 x 16,384 on the 27B config, 4.7 million
page faults and 15 s of system time out of 57 s. With mmap disabled and trimming off for the
duration, freed blocks stay in the heap and the next allocation reuses pages already mapped.
Values are untouched (this only changes where memory comes from); on leaving, the settings are
glibc's documented defaults and the free top of the heap is returned to the system. Defaults set
through mallopt are fixed ones (glibc then stops raising its thresholds with the blocks it
sees), so every later block above 128 KiB is a fresh mmap: a process that times training steps
must not run the gate first (the workflow runs it in its own rule, the trainer bench forks it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("probes.mask.gate")

M_TRIM_THRESHOLD = -1  # mallopt parameters from glibc's malloc.h
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's documented defaults, set (fixed) on exit
DEFAULT_MMAP_MAX = 65536
NO_TRIM = 2**31 - 1  # the largest int mallopt takes: no trim below 2 GiB of free heap top


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # glibc has both; musl and macOS libc lack mallopt or malloc_trim
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


@contextmanager
def reuse_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """Within the block, large allocations come from (and return to) the heap; yields whether
    the setting took effect."""
    libc = _glibc() if enabled else None
    applied = False
    if libc is not None:
        applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM)
        )
        if not applied:
            log.debug("mallopt refused; large masks are mmapped as usual")
    try:
        yield applied
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
            libc.malloc_trim(0)
