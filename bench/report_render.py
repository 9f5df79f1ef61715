"""How long rendering the report alone takes, cold: a fresh interpreter running
scripts/run_report.py (imports of pandas, pyarrow, jinja2 and matplotlib included) over stage
outputs the size of the embedded default (7,168 examples from 35 sources) or larger.

    python bench/report_render.py [--examples 7168] [--sources 35] [--repeats 5]

The issue's bound is 5 s. Inputs are the fixture tables of tests/test_report.py, scaled up.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fixture writers live with the tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=7168)
    parser.add_argument("--sources", type=int, default=35)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import stage_fixtures as fixtures  # the same builders the unit tests render from

    from probes.io import run_metadata, write_parquet
    from probes.report import render as report

    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results"
        paths = fixtures.write_results(results)
        lengths = fixtures.padding_lengths(args.examples, args.sources)
        meta = run_metadata({})
        write_parquet(lengths, paths["padding_lengths"], meta)
        for name, frame in fixtures.padding_tables(lengths).items():
            write_parquet(frame, paths[f"padding_{name}"], meta)
        command = [sys.executable, str(REPO / "scripts/run_report.py"), "--results", results]
        walls, cpus = [], []
        for _ in range(args.repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            # CPU time too: on a shared machine the wall clock also measures the neighbours
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        markdown = (results / "report/playbook-evidence.md").read_text()
        n_figures = len(report.linked_figures(markdown))
    print(
        f"report render, cold process, {args.examples:,} examples / {args.sources} sources, "
        f"{n_figures} figures: median {statistics.median(walls):.2f} s, "
        f"min {min(walls):.2f} s, max {max(walls):.2f} s over {args.repeats} runs (bound: 5 s); "
        f"CPU time median {statistics.median(cpus):.2f} s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
