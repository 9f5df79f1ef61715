# The only rule that asks for a GPU: locally `--resources gpu=1` serialises it, the SLURM
# profile turns gpu=1 into --gpus=1. It checks the card is idle before loading weights.
rule profile:
    input:
        **stage_inputs("profile", config),
    output:
        scaling=out("profile", "scaling"),
        fit=out("profile", "fit"),
        padding_penalty=out("profile", "padding_penalty"),
        ce=out("profile", "ce"),
        kernels=report(
            out("profile", "kernels"),
            category="Profile",
            caption="../report/profile.rst",
        ),
        raw=out("profile", "raw"),
        provenance=out("profile", "provenance"),
        control=out("profile", "control"),
    log:
        "logs/profile.log",
    benchmark:
        "benchmarks/profile.tsv"
    conda:
        "../envs/probes.yaml"
    threads: cpu_threads("profile")
    resources:
        gpu=1,
        timing=1,
    params:
        # the config sections the stage reads: a change reruns it
        trainer=config["trainer"],
        profile=config["profile"],
        training=config["training"],
    script:
        "../../scripts/run_profile.py"
