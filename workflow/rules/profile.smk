# The only rule that asks for a GPU: locally `--resources gpu=1` serialises it, the SLURM
# profile turns gpu=1 into --gpus=1. It checks the card is idle before loading weights.
rule profile:
    input:
        lengths="results/padding/lengths.parquet",
        recommendation="results/bucket/recommendation.json",
        model_config=model_config_json(),
        tokenizer=model_tokenizer_files(),
    output:
        scaling="results/profile/scaling.parquet",
        fit="results/profile/fit.parquet",
        padding_penalty="results/profile/padding_penalty.parquet",
        ce="results/profile/ce.parquet",
        kernels=report(
            "results/profile/kernels.parquet",
            category="Profile",
            caption="../report/profile.rst",
        ),
        raw="results/profile/profile-output.txt",
        provenance="results/profile/provenance.json",
        control="results/profile/control.json",
    log:
        "logs/profile.log",
    benchmark:
        "benchmarks/profile.tsv"
    conda:
        "../envs/probes.yaml"
    resources:
        gpu=1,
    params:
        model_path=model_dir_of_input,
        profile=config["profile"],
        training=config["training"],
    script:
        "../../scripts/step1_profile.py"
