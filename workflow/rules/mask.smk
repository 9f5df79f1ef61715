rule mask:
    input:
        **stage_inputs("mask", config),
    output:
        layers=report(
            out("mask", "layers"),
            category="Mask gate",
            caption="../report/mask.rst",
        ),
        gate=out("mask", "gate"),
        control=out("mask", "control"),
    log:
        "logs/mask.log",
    benchmark:
        "benchmarks/mask.tsv"
    conda:
        "../envs/probes.yaml"
    params:
        # the config sections the stage reads: a change reruns it
        mask=config["mask"],
        training=config["training"],
    script:
        "../../scripts/run_mask.py"
