"""The report rule inside Snakemake, with the other stages stubbed: each stub copies in its
outputs from tests/stage_fixtures.py's fixture results, written once by the test.

Checks the wiring the report owns: the rule's inputs/outputs and params, the figures directory
output, and `snakemake --report report.html` (report() captions and workflow/report/*.rst). The
real stages end to end are the lead's tests/test_workflow_e2e.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from stage_fixtures import write_results, write_stage

from conftest import REPO, STAGE_SCRIPTS
from probes.contracts import STAGE_OUTPUTS

STUBBED_SCRIPTS = {stage: script for stage, script in STAGE_SCRIPTS.items() if stage != "report"}
STUB = """\
# a stand-in for the {stage} stage: copies in its outputs from the fixture results the test wrote
# once (write_fixture_results below); building them in each stub took ~8 s a stage
import shutil
from pathlib import Path

SOURCES = {sources!r}
for key, value in snakemake.output.items():
    Path(value).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SOURCES[key], value)
"""
# complete: with --directory elsewhere the Snakefile's configfile (config/config.yaml) is not found
CONFIG = """\
model:
  path: model
data:
  files:
    - path: data.jsonl
training:
  micro_batch_size: 2
report:
  figure_dpi: 40
"""
WORKFLOW_RST_LINE = 'report: "workflow/report/workflow.rst"'


def write_fixture_results(root: Path, profile: str) -> Path:
    """Every stubbed stage's outputs under root/ (the results layout), as tests/stage_fixtures.py
    writes them; the stubs copy theirs from here."""
    write_results(root, profile=profile)
    memory = {f"memory_{key}": root / rel for key, rel in STAGE_OUTPUTS["memory"].items()}
    write_stage("memory", memory, profile=profile)
    (root / STAGE_OUTPUTS["profile"]["raw"]).write_text("raw key_averages() table\n")
    plans = root / STAGE_OUTPUTS["bucket"]["plans"]
    if not plans.exists():  # for the replay stub
        pd.DataFrame({"strategy": ["random"]}).to_parquet(plans)
    return root


def stub(stage: str, written: Path) -> str:
    sources = {key: str(written / rel) for key, rel in STAGE_OUTPUTS[stage].items()}
    return STUB.format(stage=stage, sources=sources)


def make_workdir(tmp_path: Path, profile: str) -> Path:
    """A copy of the workflow whose stage scripts are stubs (the report script is the real one),
    and a separate run directory, as `snakemake --snakefile ... --directory ...` uses them."""
    written = write_fixture_results(tmp_path / "fixture-results", profile)
    source = tmp_path / "wf"
    source.mkdir()
    for item in ("Snakefile", "workflow", "config"):
        original = REPO / item
        copy = shutil.copytree if original.is_dir() else shutil.copy
        copy(original, source / item)
    shutil.copytree(REPO / "scripts", source / "scripts", ignore=shutil.ignore_patterns("step*"))
    for stage, script in STUBBED_SCRIPTS.items():
        (source / "scripts" / script).write_text(stub(stage, written))
    # the replay (issue 12): its fixture outputs are made by the stage's own functions
    (source / "scripts" / "run_replay.py").write_text(stub("replay", written))
    snakefile = source / "Snakefile"
    if WORKFLOW_RST_LINE not in snakefile.read_text():  # the lead adds it to the real Snakefile
        snakefile.write_text(snakefile.read_text() + f"\n{WORKFLOW_RST_LINE}\n")
    work = tmp_path / "run"
    (work / "model").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (work / "model" / name).write_text("{}")
    (work / "data.jsonl").write_text('{"text": "x"}\n')
    (work / "test.yaml").write_text(CONFIG)
    return work


def snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    snakefile = work.parent / "wf" / "Snakefile"
    command = [sys.executable, "-m", "snakemake", *args, "--snakefile", str(snakefile)]
    command += ["--directory", str(work), "--configfile", str(work / "test.yaml")]
    # this checkout's package first (the editable install may point at another checkout)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO / "tests")]),
    }
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_report_rule_and_snakemake_report(tmp_path):
    from probes.report.render import linked_figures

    work = make_workdir(tmp_path, profile="gpu")
    snakemake(work, "--cores", "1", "report")
    markdown = (work / "results/report/playbook-evidence.md").read_text()
    figures = sorted(p.name for p in (work / "results/report/figures").glob("*.png"))
    expected = ["bucket.png", "dp.png", "kernels.png", "lengths.png", "memory.png"]
    expected += ["replay_epoch.png", "replay_fit.png", "scaling.png"]
    assert figures == expected
    assert sorted(Path(link).name for link in linked_figures(markdown)) == expected
    assert "rendered results/report/playbook-evidence.md" in (work / "logs/report.log").read_text()

    snakemake(work, "--report", "report.zip")
    with zipfile.ZipFile(work / "report.zip") as archive:
        names = archive.namelist()
    assert any(n.endswith("playbook-evidence.md") for n in names)
    assert all(any(n.endswith(f) for n in names) for f in expected)
    snakemake(work, "--report", "report.html")
    html = (work / "report.html").read_text()
    assert "The workflow measures, it does not guess" in html  # workflow.rst
    assert "playbook-evidence.md" in html
