"""The one config loader of standalone runs: the workflow's schema validates and fills defaults."""

import pytest
import yaml

from probes.config import DEFAULT_CONFIG, ConfigError, check_config_paths, load_config


def test_default_config_loads_with_every_section_filled():
    config = load_config()
    assert config["training"]["micro_batch_size"] >= 1
    assert config["profile"]["cpu"]["lengths"] and config["bucket"]["seeds"]
    assert config["mask"]["target_compute_capability"] == "9.0"


def test_bad_key_is_named_with_the_file(tmp_path):
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["training"]["loss_on"] = "everything"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"bad\.yaml: config key training\.loss_on"):
        load_config(path)


def test_missing_user_paths_are_named(tmp_path):
    config = load_config()
    config["model"]["path"] = "no/such/dir"
    with pytest.raises(ConfigError, match="model.path"):
        check_config_paths(config, workdir=tmp_path)
