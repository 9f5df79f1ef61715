# Measured savings (issue 12): each batching strategy's real micro-batches, a stratified sample
# timed through the harness. Asks for the GPU like profile; both serialise on gpu=1.
rule replay:
    input:
        plans="results/bucket/plans.parquet",
        lengths="results/padding/lengths.parquet",
        recommendation="results/bucket/recommendation.json",
        gate="results/mask/gate.json",
        model_config=model_config_json(),
        tokenizer=model_tokenizer_files(),
    output:
        replay=report(
            "results/profile/replay.parquet",
            category="Profile",
            caption="../report/replay.rst",
        ),
        steps="results/profile/replay_steps.parquet",
        fit="results/profile/replay_fit.parquet",
        control="results/profile/replay_control.json",
    log:
        "logs/replay.log",
    benchmark:
        "benchmarks/replay.tsv"
    conda:
        "../envs/probes.yaml"
    resources:
        gpu=1,
    params:
        model_path=model_dir_of_input,
        replay=config["replay"],
        profile=config["profile"],
        training=config["training"],
    script:
        "../../scripts/step_replay.py"
