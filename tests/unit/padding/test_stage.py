"""The padding stage end to end: bad-input buckets, no partial output, the canary, Snakemake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import CANARY, REPO, chat_rows, copy_workflow, workflow_config, write_jsonl
from probes.contracts import LENGTH_COLUMNS, STAGE_OUTPUTS
from probes.padding import stage as padding_stage
from probes.padding.data import DataError

OUTPUTS = ("lengths.parquet", "summary.parquet", "distribution.parquet", "ce_chunks.parquet")
TRAINING = {"micro_batch_size": 2, "grad_accum": 1, "max_seq_len": 128, "loss_on": "assistant"}
PADDING = {"waste_seeds": 3, "histogram_bins": 8, "reference_check_examples": 8}


def outputs_in(directory: Path) -> dict[str, str]:
    return {key: str(directory / Path(rel).name) for key, rel in STAGE_OUTPUTS["padding"].items()}


def run_stage(
    model_dir: Path, files: list[dict], outdir: Path, padding: dict | None = None, **training
) -> dict:
    cfg = workflow_config(
        model={"path": str(model_dir)},
        data={"files": files},
        padding={**PADDING, **(padding or {})},
        training={**TRAINING, **training},
    )
    inputs = {
        "model_config": str(model_dir / "config.json"),
        "tokenizer": [str(model_dir / "tokenizer.json")],
    }
    padding_stage.run(inputs, outputs_in(outdir), cfg, progress=False)
    return json.loads((outdir / "control.json").read_text())


@pytest.fixture
def messy_jsonl(tmp_path: Path) -> Path:
    """Good rows plus one of each bad kind, at known lines."""
    good = [json.dumps(row) for row in chat_rows(6)]
    long_turns = [
        {"role": "user", "content": "hello " * 200},
        {"role": "assistant", "content": "i"},
    ]
    lines = [
        good[0],
        "{not json",  # line 2: malformed
        json.dumps({"messages": []}),  # line 3: empty conversation
        json.dumps({"messages": [{"role": "wizard", "content": "hello"}]}),  # 4: unknown role
        None,  # line 5: non-UTF-8 byte
        json.dumps({"messages": long_turns}),  # line 6: longer than max_seq_len
        *good[1:],
    ]
    path = tmp_path / "messy.jsonl"
    with path.open("wb") as handle:
        for line in lines:
            handle.write(b'{"text": "caf\xe9"}\n' if line is None else line.encode() + b"\n")
    return path


def test_every_bad_row_is_counted_in_its_bucket_and_the_run_goes_on(
    tiny_model_dir, messy_jsonl, tmp_path, caplog
):
    outdir = tmp_path / "out"
    with caplog.at_level("INFO", logger="probes.padding.waste"):
        control = run_stage(tiny_model_dir, [{"path": str(messy_jsonl), "source": "s"}], outdir)
    assert control["passed"]
    lengths = pd.read_parquet(outdir / "lengths.parquet")
    by_row = lengths.set_index("row")
    assert by_row.loc[2, ["status", "reason"]].tolist() == ["ERROR", "invalid_json"]
    assert by_row.loc[3, ["status", "reason"]].tolist() == ["EMPTY", "no_content"]
    assert by_row.loc[4, ["status", "reason"]].tolist() == ["ERROR", "unknown_role"]
    assert by_row.loc[5, ["status", "reason"]].tolist() == ["ERROR", "not_utf8"]
    assert by_row.loc[6, "status"] == "TRUNCATED"
    assert by_row.loc[6, "n_tokens"] == 128 and by_row.loc[6, "n_truncated_tokens"] > 0
    assert (lengths["file"] == messy_jsonl.as_posix()).all()  # the path as given
    assert tuple(lengths.columns[: len(LENGTH_COLUMNS)]) == LENGTH_COLUMNS
    summary = pd.read_parquet(outdir / "summary.parquet")
    counts = summary[(summary["section"] == "status") & (summary["metric"] == "count")]
    assert counts.set_index("status")["value"].to_dict() == {
        "OK": 6,
        "EMPTY": 1,
        "ERROR": 3,
        "TRUNCATED": 1,
    }
    waste = summary[summary["section"] == "waste"]
    assert (waste["n_examples"] == 7).all()  # OK + TRUNCATED only
    dist = pd.read_parquet(outdir / "distribution.parquet")
    overall = dist[(dist["source"] == "(all)") & (dist["measure"] == "n_tokens")]
    assert overall[overall["statistic"] == "count"]["value"].item() == 7
    ce = pd.read_parquet(outdir / "ce_chunks.parquet")
    assert set(ce["shape"]) == {"max_seq_len", "p50", "p90", "p99", "max"}
    assert json.loads((outdir / "control.json").read_text())["passed"] is True
    assert "messy.jsonl:4 unknown_role" in caplog.text


def test_file_with_no_usable_example_fails_and_writes_nothing(tiny_model_dir, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", chat_rows(4))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"nothing": 1}])
    outdir = tmp_path / "out"
    with pytest.raises(DataError, match="bad.jsonl: no usable example"):
        run_stage(tiny_model_dir, [{"path": str(good)}, {"path": str(bad)}], outdir)
    assert not any(outdir.glob("*.parquet")) and not (outdir / "control.json").exists()


def test_data_without_assistant_turns_is_refused_with_the_cause(tiny_model_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hello how are you"}]}] * 5
    path = write_jsonl(tmp_path / "users.jsonl", rows)
    outdir = tmp_path / "out"
    with pytest.raises(DataError, match="trains \\(almost\\) nothing") as refused:
        run_stage(tiny_model_dir, [{"path": str(path)}], outdir)
    message = str(refused.value)
    assert "0 of " in message and "training.loss_on=assistant" in message
    assert "generation" in message and "padding.allow_no_loss" in message
    assert not outdir.exists() or not any(outdir.iterdir())
    # the opt-in measures it anyway
    control = run_stage(tiny_model_dir, [{"path": str(path)}], outdir, {"allow_no_loss": True})
    assert control["passed"]


def test_max_seq_len_cutting_every_assistant_turn_is_refused(tiny_model_dir, tmp_path):
    turns = [
        {"role": "user", "content": "hello " * 40},
        {"role": "assistant", "content": "pizza pasta"},
    ]
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": turns}] * 4)
    with pytest.raises(DataError, match="truncation: training.max_seq_len=16"):
        run_stage(tiny_model_dir, [{"path": str(path)}], tmp_path / "out", max_seq_len=16)


def test_cli_exits_non_zero_with_a_message_naming_the_file(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"files": [{"path": str(bad)}]},
        "training": TRAINING,
        "padding": PADDING,
    }
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    outdir = tmp_path / "out"
    script = REPO / "scripts" / "run_padding.py"
    command = [sys.executable, str(script), "--configfile", str(configfile)]
    command += ["--results", str(outdir), "--input", f"gate={configfile}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 1
    assert "bad.jsonl" in done.stderr and "Traceback" not in done.stderr
    assert not outdir.exists() or not any(outdir.rglob("*.*"))


def test_canary_reaches_no_output_log_or_stream(tiny_model_dir, tmp_path):
    rows = chat_rows(12, text=f"hello {CANARY} how are you")
    rows.append({"messages": [{"role": "user", "content": CANARY * 200}]})  # truncated, no loss
    rows.append({"messages": [{"role": "tool", "content": CANARY}]})  # unknown role
    data = write_jsonl(tmp_path / "canary.jsonl", rows)
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"files": [{"path": str(data)}]},
        "training": TRAINING,
        "padding": PADDING,
    }
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    outdir = tmp_path / "out"
    log = tmp_path / "padding.log"
    script = REPO / "scripts" / "run_padding.py"
    command = [sys.executable, str(script), "--configfile", str(configfile)]
    command += ["--results", str(outdir), "--log", str(log)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    produced = sorted((outdir / "padding").iterdir())
    assert len(produced) == 5
    assert CANARY not in done.stdout and CANARY not in done.stderr
    assert CANARY not in log.read_text()
    needle = CANARY.encode()
    for path in produced:
        assert needle not in path.read_bytes(), path.name
        if path.suffix == ".parquet":
            table = pq.read_table(path)
            assert needle not in json.dumps(table.to_pylist(), default=str).encode()
            assert needle not in repr(table.schema.metadata).encode()


def snakemake_workdir(tmp_path: Path, model_dir: Path) -> Path:
    """A copy of the workflow with tiny inputs and the mask gate already in place."""
    workdir = copy_workflow(tmp_path / "wf")
    write_jsonl(workdir / "data.jsonl", chat_rows(20))
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["model"] = {"path": str(model_dir), "chat_template": None}
    config["data"] = {"files": [{"path": "data.jsonl", "source": "tiny"}]}
    config["training"] = TRAINING
    config["padding"] = PADDING
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    gate = workdir / "results" / "mask" / "gate.json"
    gate.parent.mkdir(parents=True)
    gate.write_text("{}\n")
    return workdir


@pytest.mark.slow
def test_snakemake_padding_rule_writes_every_output(tiny_model_dir, tmp_path):
    workdir = snakemake_workdir(tmp_path, tiny_model_dir)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--cores",
            "2",
            "padding",
            "--allowed-rules",
            "padding",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in OUTPUTS + ("control.json",):
        assert (workdir / "results" / "padding" / name).is_file(), name
    lengths = pd.read_parquet(workdir / "results" / "padding" / "lengths.parquet")
    assert len(lengths) == 20 and set(lengths["source"]) == {"tiny"}
