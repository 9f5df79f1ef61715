"""Replay: measured epoch time of every batching strategy (a stratified sample of its real
micro-batches through the harness), with bootstrap intervals, a scaling fit over the data's own
lengths, and a positive control on a synthetic harness of known cost.

Run by `snakemake replay`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/run_replay.py --results results --set profile.device=cuda
"""

from probes.step.threads import steady_allocator

steady_allocator()  # before torch: glibc reads its settings at start

from probes.replay import stage as replay_stage  # noqa: E402
from probes.stage import main  # noqa: E402

main("replay", replay_stage.run, __doc__, globals())
