rule padding:
    input:
        **stage_inputs("padding", config),
    output:
        lengths=out("padding", "lengths"),
        summary=report(
            out("padding", "summary"),
            category="Padding",
            caption="../report/padding.rst",
        ),
        distribution=out("padding", "distribution"),
        ce_chunks=out("padding", "ce_chunks"),
        control=out("padding", "control"),
    log:
        "logs/padding.log",
    benchmark:
        "benchmarks/padding.tsv"
    conda:
        "../envs/probes.yaml"
    threads: 2
    params:
        # the config sections the stage reads: a change reruns it
        trainer=config["trainer"],
        data=config["data"],
        padding=config["padding"],
        training=config["training"],
        model=config["model"],
    script:
        "../../scripts/run_padding.py"
