"""Padding probe: how long the examples really are once tokenized with the chat template, how
much of each micro-batch is padding, and how the cross-entropy over the vocabulary must be
chunked to fit.

Run by Snakemake (rule `padding`) or standalone:
    python scripts/run_padding.py --configfile config/config.yaml --results results
"""

from probes.padding import stage as padding_stage
from probes.stage import main

main("padding", padding_stage.run, __doc__, globals())
