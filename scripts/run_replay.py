"""Replay: measured epoch time of every batching strategy (a stratified sample of its real
micro-batches through the harness), with bootstrap intervals, a scaling fit over the data's own
lengths, and a positive control on a synthetic harness of known cost.

Run by `snakemake replay`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/run_replay.py --results results --set profile.device=cuda
"""

from probes.replay import stage as replay_stage
from probes.stage import main

main("replay", replay_stage.run, __doc__, globals())
