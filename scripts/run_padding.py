"""Padding probe: how long the examples really are once tokenized with the chat template, how
much of each micro-batch is padding, and how the cross-entropy over the vocabulary must be
chunked to fit.

Run by Snakemake (rule `padding`) or standalone:
    python scripts/run_padding.py --configfile config/config.yaml --results results
"""

from probes.config import model_file
from probes.padding import stage as padding_stage
from probes.stage import main, upstream


def inputs(cfg, results):
    return {
        **upstream(results, gate=("mask", "gate")),
        "model_config": model_file(cfg.raw, "config.json"),
        "tokenizer": [model_file(cfg.raw, "tokenizer.json")],
        "data": [entry.path for entry in cfg.data.files],
    }


main("padding", padding_stage.run, __doc__, inputs, globals())
