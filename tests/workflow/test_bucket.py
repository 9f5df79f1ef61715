"""End to end: `snakemake bucket_sweep` on a synthetic lengths table in a copy of the workflow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_workflow
from probes.bucket import control as bucket_controls

# the module-scoped run is made once: both tests of the module on one worker
pytestmark = pytest.mark.xdist_group("bucket_workflow")
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def _workflow_copy(tmp_path: Path) -> Path:
    work = copy_workflow(tmp_path / "wf")
    lengths = work / "results" / "padding" / "lengths.parquet"
    lengths.parent.mkdir(parents=True)
    bucket_controls.synthetic_lengths_frame(2000, seed=11, max_seq_len=4096).to_parquet(lengths)
    return work


def _snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SNAKEMAKE), *args], cwd=work, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def bucket_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One `snakemake bucket_sweep` in a copy of the workflow, without --cores: the workflow's
    default profile (profiles/default) supplies them, as a user who types none relies on."""
    work = _workflow_copy(tmp_path_factory.mktemp("bucket"))
    if not (work / "profiles" / "default").exists():
        pytest.skip(
            "snakemake finds a default profile only in profiles/default beside a root Snakefile; "
            "workflow/profiles/default is not searched"
        )
    return work, _snakemake(work, "bucket_sweep")


@pytest.mark.slow
def test_snakemake_bucket_sweep_end_to_end(bucket_run):
    work, run = bucket_run
    assert run.returncode == 0, run.stderr[-3000:]
    results = work / "results" / "bucket"
    for name in ("sweep.parquet", "summary.parquet", "recommendation.json", "control.json"):
        assert (results / name).is_file()
    control = json.loads((results / "control.json").read_text())
    assert control["passed"] is True
    recommendation = json.loads((results / "recommendation.json").read_text())
    assert recommendation["training"]["micro_batch_size"] == 2  # the default config
    assert "recommended bucket size" in (work / "logs" / "bucket_sweep.log").read_text()
    # Only this stage ran: the padding output was taken as given.
    assert "padding" not in run.stderr.split("Job stats:")[1].split("Select jobs")[0]


@pytest.mark.slow
def test_snakemake_bucket_sweep_without_cores(bucket_run):
    # the same run (one Snakemake run for both): no --cores on its command line
    work, run = bucket_run
    assert "--cores" not in run.args
    assert run.returncode == 0, run.stderr[-3000:]
