"""One entry shape: every stage script runs standalone, fails with one message and exit code 1,
and writes all of its outputs or none (probes.stage)."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, STAGE_SCRIPTS
from probes.contracts import STAGE_OUTPUTS
from probes.errors import ProbeError
from probes.stage import all_or_nothing, call_stage

SCRIPTS = STAGE_SCRIPTS


def script(stage: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / SCRIPTS[stage]), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("stage", sorted(SCRIPTS))
def test_every_script_has_the_same_help(stage):
    helped = script(stage, "--help")
    assert helped.returncode == 0, helped.stderr
    for flag in ("--configfile", "--results", "--input", "--output", "--set", "--log"):
        assert flag in helped.stdout
    for key in STAGE_OUTPUTS[stage]:  # the output keys it writes, from the contract
        assert key in helped.stdout
    listed = " ".join(helped.stdout.split("Input keys:")[1].split("Output keys")[0].split())
    assert listed and listed != "none."  # the real input keys, not "none"


@pytest.mark.parametrize("stage", sorted(SCRIPTS))
def test_scripts_are_thin(stage):
    lines = (REPO / "scripts" / SCRIPTS[stage]).read_text().splitlines()
    assert len(lines) <= 60, f"{SCRIPTS[stage]}: {len(lines)} lines; logic belongs in probes"


def test_missing_input_exits_1_naming_the_file_and_writes_nothing(tmp_path):
    missing = tmp_path / "none.parquet"
    run = script("bucket", "--input", f"lengths={missing}", "--results", str(tmp_path / "out"))
    assert run.returncode == 1
    assert str(missing) in run.stderr and "padding" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_bad_config_value_exits_1_naming_the_key(tmp_path):
    run = script("bucket", "--set", "bucket.gain_share=lots", "--results", str(tmp_path))
    assert run.returncode == 1
    assert "bucket.gain_share" in run.stderr and "Traceback" not in run.stderr


def test_unknown_output_key_is_refused(tmp_path):
    run = script("bucket", "--output", "sweeep=x.parquet", "--results", str(tmp_path))
    assert run.returncode == 1 and "sweeep" in run.stderr


def test_upstream_output_from_another_config_is_refused_naming_both_hashes(tmp_path):
    from probes.bucket.control import synthetic_lengths_frame
    from probes.config import load_config
    from probes.io import config_hash, run_metadata, write_parquet
    from probes.stage import upstream_config_mismatches

    other = load_config(overrides={"training.max_seq_len": "1024"})
    lengths = tmp_path / "padding" / "lengths.parquet"
    lengths.parent.mkdir()
    write_parquet(
        synthetic_lengths_frame(50, seed=0, max_seq_len=1024), lengths, run_metadata(other)
    )
    mine = load_config()
    problems = upstream_config_mismatches({"lengths": str(lengths)}, str(tmp_path), mine)
    theirs, ours = (config_hash({"training": c["training"]}) for c in (other, mine))
    assert problems == [
        f"--input lengths={lengths}: written by the padding stage with config section "
        f"'training' hash {theirs}, this run's is {ours}"
    ]
    # a section only a later stage reads is no mismatch for the padding stage's output
    bucket_only = load_config(overrides={"training.max_seq_len": "1024", "bucket.seeds": "[0]"})
    assert upstream_config_mismatches({"lengths": str(lengths)}, str(tmp_path), bucket_only) == []
    run = script("bucket", "--results", str(tmp_path))
    assert run.returncode == 1 and "--allow-config-mismatch" in run.stderr
    assert theirs in run.stderr and ours in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "bucket").exists()


def test_outputs_are_all_or_nothing(tmp_path):
    paths = {"table": tmp_path / "t.parquet", "record": tmp_path / "r.json"}
    with pytest.raises(RuntimeError, match="boom"), all_or_nothing(paths) as out:
        out.parquet("table", pd.DataFrame({"x": [1]}), {})
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staged temp file
    with all_or_nothing(paths) as out:
        out.parquet("table", pd.DataFrame({"x": [1]}), {})
        out.json("record", {"ok": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "t.parquet"]
    assert json.loads(paths["record"].read_text()) == {"ok": True}


def test_an_unwritten_output_fails_the_stage(tmp_path):
    paths = {"table": tmp_path / "t.parquet", "record": tmp_path / "r.json"}
    with pytest.raises(RuntimeError, match="record"), all_or_nothing(paths) as out:
        out.json("table", {})
    assert list(tmp_path.iterdir()) == []


def test_a_figures_directory_replaces_the_old_one_at_commit(tmp_path):
    target = tmp_path / "figures"
    target.mkdir()
    (target / "stale.png").write_bytes(b"old")
    with all_or_nothing({"figures": target}) as out:
        (out.directory("figures") / "new.png").write_bytes(b"new")
        assert (target / "stale.png").exists()  # untouched until the stage succeeded
    assert [p.name for p in target.iterdir()] == ["new.png"]


def test_probe_errors_become_exit_code_1_other_errors_propagate(caplog):
    def bad_input(inputs, outputs, cfg):
        raise ProbeError("lengths.parquet: column n_tokens missing")

    def bug(inputs, outputs, cfg):
        raise ZeroDivisionError

    log = __import__("logging").getLogger("test")
    assert call_stage(bad_input, {}, {}, None, log) == 1
    assert "column n_tokens missing" in caplog.text
    with pytest.raises(ZeroDivisionError):
        call_stage(bug, {}, {}, None, log)


def test_an_example_config_is_merged_over_the_default_as_snakemake_does():
    from probes.config import load_config

    example = load_config(REPO / "config" / "mask-gemma3-27b.yaml")
    default = load_config()
    assert example["model"]["config_path"].endswith("gemma-3-27b-it/config.json")
    assert example["data"] == default["data"]  # not in the example: the default's
    assert example["training"]["grad_accum"] == default["training"]["grad_accum"]
    assert example["training"]["max_seq_len"] == 16384  # the training shape the gate checks
