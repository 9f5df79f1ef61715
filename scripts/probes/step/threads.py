"""How many CPU threads a timing stage uses: one fact for the rule (Snakemake's `threads`, which
reserves the cores so nothing runs beside it) and for the stage (torch's intra-op threads).

On CPU a timed step is the whole point of the run: one thread on a 2-core machine left a core idle
(the trainer's micro-batch 2 x 16 took 0.93 s on one thread, 0.60 s on two), while two threads
*beside another job* thrash (5-10x slower). So a timing rule takes every core it is given and
Snakemake runs nothing beside it; `profile.cpu.threads` / `replay.cpu.threads` set a count.
Light on purpose: the Snakefile imports it.
"""

from __future__ import annotations

import os

# set by probes.stage.main from the rule's `threads` (capped by Snakemake at --cores)
RULE_THREADS_ENV = "PROBES_RULE_THREADS"


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a SLURM job's CPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def timing_threads(configured: int | None) -> int:
    """The CPU threads of a timing stage: the configured count; else the rule's threads (what
    Snakemake reserved); else every core this process may run on."""
    if configured is not None:
        return int(configured)
    from_rule = os.environ.get(RULE_THREADS_ENV)
    return int(from_rule) if from_rule else available_cores()


# glibc's allocator keeping what a step frees: without it every micro-batch's large tensors
# (the 262k-vocabulary logits) were fresh mmaps, paid in page faults each time. On the default
# trainer on a 2-core CPU a 2 x 32 micro-batch took 0.78 s with these against 1.08 s without
# (40 in a row, two runs each), none of the three alone helped.
STEADY_ALLOCATOR = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": "-1",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
}
STEADY_ALLOCATOR_OFF = "PROBES_STEADY_ALLOCATOR"  # "0" keeps the allocator's defaults


def steady_allocator(argv: list[str] | None = None) -> None:
    """Run this timing script with STEADY_ALLOCATOR: glibc reads it at start, so the process
    starts itself once more with it set (Linux; nothing to do where it is set already)."""
    import sys

    if not sys.platform.startswith("linux") or os.environ.get(STEADY_ALLOCATOR_OFF) == "0":
        return
    if all(os.environ.get(k) == v for k, v in STEADY_ALLOCATOR.items()):
        return
    env = {**os.environ, **STEADY_ALLOCATOR}
    try:
        os.execve(sys.executable, [sys.executable, *(argv if argv is not None else sys.argv)], env)
    except OSError as error:  # the interpreter cannot be started again: time with the defaults
        print(f"probes: glibc allocator settings not applied ({error}); timing runs on", flush=True)
