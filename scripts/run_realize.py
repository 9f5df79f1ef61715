"""Realize: real training steps (a simple random sample of whole optimizer steps) of the baseline
and the replay's top changes, the realized epoch time and saving with intervals, and the verdict
against the replay's promise.

Run by `snakemake realize`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/run_realize.py --results results --set profile.device=cuda
"""

from probes.realize import stage as realize_stage
from probes.stage import main

main("realize", realize_stage.run, __doc__, globals())
