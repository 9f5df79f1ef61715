rule bucket_sweep:
    input:
        **stage_inputs("bucket", config),
    output:
        sweep=report(
            out("bucket", "sweep"),
            category="Bucketing",
            caption="../report/bucket.rst",
        ),
        summary=out("bucket", "summary"),
        recommendation=out("bucket", "recommendation"),
        control=out("bucket", "control"),
        plans=out("bucket", "plans"),
        data_parallel=out("bucket", "data_parallel"),
    log:
        "logs/bucket_sweep.log",
    benchmark:
        "benchmarks/bucket_sweep.tsv"
    conda:
        "../envs/probes.yaml"
    params:
        # the config sections the stage reads: a change reruns it
        bucket=config["bucket"],
        training=config["training"],
    script:
        "../../scripts/run_bucket_sweep.py"
