rule memory:
    input:
        **stage_inputs("memory", config),
    output:
        shapes=report(
            out("memory", "shapes"),
            category="Memory",
            caption="../report/memory.rst",
        ),
        changes=out("memory", "changes"),
        fit=out("memory", "fit"),
        sharded=out("memory", "sharded"),
        summary=out("memory", "summary"),
        control=out("memory", "control"),
    log:
        "logs/memory.log",
    benchmark:
        "benchmarks/memory.tsv"
    conda:
        "../envs/probes.yaml"
    resources:
        # no GPU, but its tracing would take the cores a timing rule's steps need
        timing=1,
    params:
        # the config sections the stage reads: a change reruns it
        memory=config["memory"],
        training=config["training"],
        dtype=config["mask"]["dtype"],
        harness=config["profile"]["harness"],
        harness_options=config["profile"]["harness_options"],
        ce_chunk_tokens=config["profile"]["ce_chunk_tokens"],
        attn_implementation=config["profile"]["attn_implementation"],
        trainer=config["trainer"],
        bucket_seeds=config["bucket"]["seeds"],
        step_changes=config["replay"]["step_changes"],
    script:
        "../../scripts/run_memory.py"
