rule report:
    input:
        # every probe output, keyed <stage>_<key> (probes.contracts.report_inputs)
        **report_inputs(),
        # optional stages' outputs when they run: data_parallel at training.world_size > 1, memory
        # when memory.enabled (without it the first screen's memory column says "not predicted")
        **optional_report_inputs(config),
        # from the workflow source, not the working directory (--directory elsewhere)
        template=workflow.source_path("../templates/playbook-evidence.md.j2"),
    output:
        markdown=report(
            out("report", "markdown"),
            category="Report",
            caption="../report/report.rst",
        ),
        figures=report(
            directory(out("report", "figures")),
            patterns=["{name}.png"],
            category="Report",
            labels={"figure": "{name}"},
            caption="../report/figures.rst",
        ),
        # every recommended change as settings for the installed libraries (probes.apply.document)
        recommendations=out("report", "recommendations"),
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        "../envs/probes.yaml"
    params:
        # the config sections the stage reads: a change reruns it
        report=config["report"],
    script:
        "../../scripts/run_report.py"
