"""Realize: real training steps (a simple random sample of whole optimizer steps) of the baseline
and the replay's top changes, the realized epoch time and saving with intervals, and the verdict
against the replay's promise.

Run by `snakemake realize`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/run_realize.py --results results --set profile.device=cuda
"""

from probes.step.threads import steady_allocator

steady_allocator()  # before torch: glibc reads its settings at start

from probes.realize import stage as realize_stage  # noqa: E402
from probes.stage import main  # noqa: E402

main("realize", realize_stage.run, __doc__, globals())
