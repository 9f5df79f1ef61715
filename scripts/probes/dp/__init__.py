"""The data_parallel stage: real DDP optimizer steps under torchrun, each rank its shard of the
bucket stage's plans, against the prediction from one-process timings (issue 22)."""
