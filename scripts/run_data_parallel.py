"""Data parallel: real DDP / FSDP2 optimizer steps of random batching and the recommended strategy
under torchrun (W = training.world_size ranks; gloo on CPU, NCCL on CUDA), each rank the user's
trainer (its own distributed batches) or the harness on its shard, against the prediction from
one-process timings. Runs only with training.world_size > 1.

Run by `snakemake data_parallel --config training='{world_size: 2}'`, or standalone:
    python scripts/run_data_parallel.py --results results --set training.world_size=2
"""

from probes.dp import stage as dp_stage
from probes.stage import main

main("data_parallel", dp_stage.run, __doc__, globals())
