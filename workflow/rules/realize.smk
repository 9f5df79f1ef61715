# Promised vs realized (issue 20): real training steps of the baseline and the replay's top
# changes. Asks for the GPU like profile and replay; all three serialise on gpu=1.
rule realize:
    input:
        **stage_inputs("realize", config),
    output:
        realized=out("realize", "realized"),
        steps=out("realize", "steps"),
        summary=out("realize", "summary"),
        control=out("realize", "control"),
    log:
        "logs/realize.log",
    benchmark:
        "benchmarks/realize.tsv"
    conda:
        "../envs/probes.yaml"
    threads: cpu_threads("replay")
    resources:
        gpu=1,
        timing=1,
    params:
        # the config sections the stage reads: a change reruns it
        trainer=config["trainer"],
        realize=config["realize"],
        replay=config["replay"],
        profile=config["profile"],
        training=config["training"],
    script:
        "../../scripts/run_realize.py"
