rule mask:
    input:
        model_config=model_config_json(),
    output:
        layers=report(
            "results/mask/layers.parquet",
            category="Mask gate",
            caption="../report/mask.rst",
        ),
        gate="results/mask/gate.json",
        control="results/mask/control.json",
    log:
        "logs/mask.log",
    benchmark:
        "benchmarks/mask.tsv"
    conda:
        "../envs/probes.yaml"
    params:
        mask=config["mask"],
        training=config["training"],
    script:
        "../../scripts/step0_mask.py"
