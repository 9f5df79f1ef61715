"""Will it fit: the peak memory of one training step per shape (training shape, p99 length, each
strategy's largest micro-batch) on fake tensors, against the target GPU. Needs the model's
config.json (no weights, no GPU) and, for the per-strategy shapes, the bucket stage's plans.

Run by the `memory` rule, or standalone, e.g. Gemma 3 27B at 2 x 16,384 (training shape only):
    python scripts/run_memory.py --configfile config/mask-gemma3-27b.yaml \\
        --set training.max_seq_len=16384 --input plans=
"""

from probes.memory import stage as memory_stage
from probes.stage import main

main("memory", memory_stage.run, __doc__, globals())
