import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("8.20")

# The shared package lives beside the entry scripts; rules and scripts import the same code.
sys.path.insert(0, str(Path(workflow.basedir) / "scripts"))
from probes.config import check_config_paths, model_file

# Fills defaults and rejects unknown keys and bad types before any job runs.
validate(config, schema="../schemas/config.schema.yaml")
# A user path that does not exist fails here, at parse time, naming its key.
check_config_paths(config)


def model_config_json():
    return model_file(config, "config.json")


def model_tokenizer_files():
    return [
        model_file(config, "tokenizer.json"),
        model_file(config, "tokenizer_config.json"),
    ]


def data_files():
    return [entry["path"] for entry in config["data"]["files"]]


def model_dir_of_input(wildcards, input):
    # Derived from the input, not the config, so it also holds without a shared filesystem.
    return str(Path(input.tokenizer[0]).parent)
