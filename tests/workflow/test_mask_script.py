"""The entry script: outputs, failure without partial outputs, --help, and the Snakemake rule."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO, TINY_GEMMA3_CONFIG, workflow_config
from probes.contracts import STAGE_OUTPUTS
from probes.mask import stage as mask_stage
from probes.stage import call_stage

SCRIPT = REPO / "scripts" / "run_mask.py"


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_GEMMA3_CONFIG))
    return path


def run_main(config_path: Path, outdir: Path, **mask_cfg) -> int:
    """The stage through the one entry (probes.stage.call_stage), as its script runs it."""
    cfg = workflow_config(mask=mask_cfg, training={"micro_batch_size": 2, "max_seq_len": 24})
    outputs = {key: str(outdir / Path(rel).name) for key, rel in STAGE_OUTPUTS["mask"].items()}
    inputs = {"model_config": str(config_path)}
    return call_stage(mask_stage.run, inputs, outputs, cfg, logging.getLogger("probes.mask.gate"))


def test_main_writes_layers_gate_and_control(tiny_config: Path, tmp_path: Path):
    outdir = tmp_path / "out"
    assert run_main(tiny_config, outdir, scenarios=["train", "packed"]) == 0
    gate = json.loads((outdir / "gate.json").read_text())
    control = json.loads((outdir / "control.json").read_text())
    layers = pd.read_parquet(outdir / "layers.parquet")
    assert gate["passed"] and gate["control"]["passed"] and control["passed"]
    assert gate["headline"] == (
        "1 of 4 decoder layers keep SDPA's is_causal fast path at the training shape 2x24"
    )
    assert len(layers) == 8 and set(layers["scenario"]) == {"train", "packed"}
    # which shape each verdict was checked at (at 2 x 24 the semantic shape is the training one)
    assert gate["shapes"]["training"] == gate["shapes"]["semantic"] == "2x24"
    assert [(s["dispatch_shape"], s["band_shape"]) for s in gate["scenarios"]] == [
        ("2x24", "2x24"),
        ("1x24", "1x24"),
    ]
    assert set(layers["band_shape"]) == {"2x24", "1x24"}
    flex = gate["implementations"]["flex_attention"]["per_scenario"]
    assert [(s["scenario"], s["checked_at"]) for s in flex] == [("packed", "1x24")]
    assert "provenance" in gate and gate["provenance"]["config_hash"]


def test_main_fails_without_partial_outputs_on_a_violation(
    tiny_config: Path, tmp_path: Path, caplog
):
    outdir = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        assert run_main(tiny_config, outdir, scenarios=["train"], expected_sliding_window=9) == 1
    assert not (outdir / "gate.json").exists() and not (outdir / "layers.parquet").exists()
    log = caplog.text
    assert "mask gate FAILED" in log and "layer 0 (sliding_attention, expected window 9)" in log


def test_main_can_write_a_failing_gate_when_asked(tiny_config: Path, tmp_path: Path):
    outdir = tmp_path / "out"
    code = run_main(
        tiny_config, outdir, scenarios=["train"], expected_sliding_window=9, fail_on_violation=False
    )
    assert code == 0
    gate = json.loads((outdir / "gate.json").read_text())
    assert gate["passed"] is False and gate["violations_total"] == 3


def test_bad_config_json_names_the_file(tmp_path: Path, caplog):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 3}')
    outdir = tmp_path / "out"
    assert run_main(bad, outdir) == 1
    assert "key 'model_type' missing" in caplog.text and str(bad) in caplog.text
    assert not outdir.joinpath("gate.json").exists()


def test_standalone_run_on_the_shipped_example(tiny_config: Path, tmp_path: Path):
    """The documented standalone form: --set model.config_path=... with the uniform flags."""
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--results",
            str(tmp_path),
            "--set",
            f"model.config_path={tiny_config}",
            "--set",
            "training.max_seq_len=24",
            "--set",
            "mask.scenarios=[train]",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "mask" / "gate.json").read_text())["passed"]


def test_example_config_validates_against_the_schema():
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    example = yaml.safe_load((REPO / "config" / "mask-gemma3-27b.yaml").read_text())
    for key, value in example.items():
        config[key] = {**config.get(key, {}), **value}
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert config["mask"]["max_mask_gib"] == 8  # defaults filled in
    assert (REPO / config["model"]["config_path"]).is_file()


@pytest.mark.slow
def test_snakemake_mask_rule_end_to_end(tiny_config: Path, tmp_path: Path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tmp_path / "config.yaml"
    configfile.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_config.parent)},
                "data": {"files": [{"path": "resources/data/chitchat.parquet"}]},
                "training": {"micro_batch_size": 2, "max_seq_len": 24},
                "mask": {"scenarios": ["train", "right_padded", "packed"]},
            }
        )
    )
    subprocess.run(
        [
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "--cores",
            "1",
            "mask",
            "--configfile",
            str(configfile),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    gate = json.loads((workdir / "results" / "mask" / "gate.json").read_text())
    assert gate["passed"] and len(gate["scenarios"]) == 3
    assert (workdir / "results" / "mask" / "control.json").is_file()
