"""The one config loader of standalone runs: the workflow's schema validates and fills defaults."""

import sys
from pathlib import Path

import pytest
import yaml

from probes.config import (
    DEFAULT_CONFIG,
    ConfigError,
    check_config_paths,
    find_module_spec,
    load_config,
)


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


@pytest.mark.parametrize(
    ("harness", "expected"),
    [
        ("/nonexistent.py", "file '/nonexistent.py' does not exist"),
        ("harnesses/train.py", "file 'harnesses/train.py' does not exist"),
        ("harnesses/train", "is not a .py file"),
        ("probes.no_such_harness", "no module 'probes.no_such_harness'"),
        ("no_such_package_7f3a.train", "no module 'no_such_package_7f3a.train'"),
        ("probes.reference_harness.deeper", "no module"),  # a module is not a package
        ("my-package.train", "no module"),
    ],
)
def test_harness_that_cannot_be_found_is_named_with_what_to_do(tmp_path, harness, expected):
    config = load_config()
    config["profile"]["harness"] = harness
    with pytest.raises(ConfigError, match="config key profile.harness") as caught:
        check_config_paths(config, workdir=tmp_path)
    assert expected in str(caught.value)
    assert "discover_target_modules" in str(caught.value)


def test_harness_file_relative_to_the_workdir_and_import_paths_pass(tmp_path):
    (tmp_path / "harnesses").mkdir()
    (tmp_path / "harnesses" / "train.py").write_text(
        "raise RuntimeError('never imported')\n"
        "def discover_target_modules(model): ...\n"
        "try:\n    from torch import nn\nexcept ImportError:\n    nn = None\n"
        "compute_loss = lambda model, batch: None\n"
    )
    config = load_config()
    for harness in ("harnesses/train.py", "probes.reference_harness"):
        config["profile"]["harness"] = harness
        check_config_paths(config, workdir=tmp_path)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def compute_loss(model, batch): ...\n", "defines no ['discover_target_modules']"),
        ("x = 1\n", "defines no ['discover_target_modules', 'compute_loss']"),
        ("def compute_loss(:\n", "does not parse line 1"),
    ],
)
def test_harness_without_its_required_functions_is_refused_at_parse_time(
    tmp_path, source, expected
):
    (tmp_path / "train.py").write_text(source)
    config = load_config()
    config["profile"]["harness"] = "train.py"
    with pytest.raises(ConfigError, match="config key profile.harness") as caught:
        check_config_paths(config, workdir=tmp_path)
    assert expected in str(caught.value)


def test_import_path_without_the_required_functions_is_refused():
    config = load_config()
    config["profile"]["harness"] = "json.decoder"  # found, read, never imported
    with pytest.raises(ConfigError, match=r"json\.decoder.*defines no"):
        check_config_paths(config)


@pytest.mark.parametrize(
    ("assignment", "key"),
    [
        ({"training.max_seq_len": "abc"}, "training.max_seq_len"),
        ({"training.nope": "1"}, "training"),
        ({"nope.x": "1"}, r"\(top level\)"),
    ],
)
def test_set_errors_name_the_set_not_the_config_file(assignment, key):
    dotted, text = next(iter(assignment.items()))
    with pytest.raises(ConfigError, match=rf"^--set {dotted}={text}: config key {key}"):
        load_config(overrides=assignment)


def test_import_path_is_found_without_running_the_package(tmp_path, monkeypatch):
    package = tmp_path / "user_pkg_7f3a"
    (package / "sub").mkdir(parents=True)
    marker = tmp_path / "imported"
    init = f"open({str(marker)!r}, 'w').close()\n"
    (package / "__init__.py").write_text(init)
    (package / "sub" / "__init__.py").write_text(init)
    (package / "sub" / "train.py").write_text(init)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = find_module_spec("user_pkg_7f3a.sub.train")
    assert spec is not None and Path(spec.origin) == package / "sub" / "train.py"
    assert find_module_spec("user_pkg_7f3a.sub.absent") is None
    assert not marker.exists() and "user_pkg_7f3a" not in sys.modules
