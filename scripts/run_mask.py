"""Mask gate: per decoder layer, the mask band and the SDPA backend, from the model's config.json.
Needs no weights and no GPU.

Run by the `mask` rule, or standalone, e.g. for the shipped Gemma 3 27B config at 2 x 16,384:
    python scripts/run_mask.py --configfile config/mask-gemma3-27b.yaml
    python scripts/run_mask.py --set model.config_path=path/to/config.json \\
        --set training.max_seq_len=4096
"""

from probes.mask import stage as mask_stage
from probes.stage import main

main("mask", mask_stage.run, __doc__, globals())
