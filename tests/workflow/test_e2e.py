"""The real workflow, end to end with Snakemake, on a tiny model and data that carry a canary,
through the user's own trainer: an SFTTrainer built by a factory (trainer.factory) as the
embedded default is.

The canary is in every message's content; it must reach no file under results/, no log and no
stdout/stderr of the run. The rendered report passes the markdown checks (probes.report.lint).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainer_factories import write_factory

from conftest import CANARY, REPO, WIRING_TRIMS, chat_rows, write_jsonl
from probes.report.lint import problems
from probes.report.render import SECTION_TITLES


def tiny_config(tmp_path: Path, model_dir: Path) -> Path:
    data = write_jsonl(tmp_path / "canary.jsonl", chat_rows(40, text=f"hello {CANARY} today"))
    factory = write_factory(tmp_path, model_dir, data, "sft", micro=2, accum=2, max_length=96)
    config = {
        "model": {"path": str(model_dir)},
        "data": {"files": [{"path": str(data)}]},
        "trainer": {"factory": factory},
        "training": {"micro_batch_size": 2, "grad_accum": 2, "max_seq_len": 96},
        "profile": {
            "device": "cpu",
            "cpu": {"lengths": [16, 32, 64], "warmup": 1, "repeats": 2, "threads": 1},
        },
        **WIRING_TRIMS,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_workflow_runs_every_stage_and_leaks_no_text(tmp_path, tiny_model_dir):
    config = tiny_config(tmp_path, tiny_model_dir)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "report",
            "--cores",
            "2",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(tmp_path),
            "--configfile",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert CANARY not in run.stdout + run.stderr

    produced = [
        path
        for folder in ("results", "logs", ".snakemake/log")
        for path in (tmp_path / folder).rglob("*")
        if path.is_file()
    ]
    assert len(produced) > 20
    leaked = [str(path) for path in produced if CANARY.encode() in path.read_bytes()]
    assert leaked == []

    report = (tmp_path / "results/report/playbook-evidence.md").read_text()
    assert re.findall(r"^## (.+)$", report, re.MULTILINE) == list(SECTION_TITLES)
    assert problems(report) == []
    assert "SFTTrainer" in report  # the first screen says which trainer was timed
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert len(figures) >= 4
    for figure in figures:
        assert (tmp_path / "results/report" / figure).is_file(), figure
