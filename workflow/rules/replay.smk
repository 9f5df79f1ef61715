# Measured savings (issue 12): each batching strategy's real micro-batches, a stratified sample
# timed through the harness. Asks for the GPU like profile; both serialise on gpu=1.
rule replay:
    input:
        **stage_inputs("replay", config),
    output:
        estimates=report(
            out("replay", "estimates"),
            category="Profile",
            caption="../report/replay.rst",
        ),
        steps=out("replay", "steps"),
        fit=out("replay", "fit"),
        control=out("replay", "control"),
        plans=out("replay", "plans"),
    log:
        "logs/replay.log",
    benchmark:
        "benchmarks/replay.tsv"
    conda:
        "../envs/probes.yaml"
    threads: cpu_threads("replay")
    resources:
        gpu=1,
        timing=1,
    params:
        # the config sections the stage reads: a change reruns it
        trainer=config["trainer"],
        replay=config["replay"],
        profile=config["profile"],
        training=config["training"],
    script:
        "../../scripts/run_replay.py"
