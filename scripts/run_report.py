"""Render results/report/playbook-evidence.md and its figures from every stage's outputs.

Run by `snakemake report`, or standalone:
    python scripts/run_report.py --results results
"""

from probes.contracts import optional_report_inputs, report_inputs
from probes.report import stage as report_stage
from probes.stage import main


def inputs(cfg, results):
    return {
        **report_inputs(results),
        **optional_report_inputs(cfg.raw, results),
        "template": str(report_stage.DEFAULT_TEMPLATE),
    }


main("report", report_stage.run, __doc__, globals(), inputs)
