"""Where the minutes of a cold default run go: per-rule wall and CPU time (issue 13).

Copies the workflow as a user checks it out (no results/, no resources/) into a temporary
directory, runs `snakemake --cores 2 report` there once, cold, and prints the table of the
benchmark files every rule writes (`benchmark:`; columns s and cpu_time), with the run's total
wall time against the 5-minute budget, the load the machine ran under and the profile's dtype.

    python bench/default_run.py [--cores 2] [--keep]
    python bench/default_run.py --configfile config/trainer.yaml   # what `make run` runs
    python bench/default_run.py --directory DIR   # only the table, from a run already made there

It runs the whole default workflow (minutes): run it once, not in a loop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import copy_workflow  # noqa: E402 (the one copy of "the workflow as checked out")

BUDGET_S = 300.0  # issue 13: the whole default workflow cold within 5 minutes on 2 AVX2 cores
TARGET = "report"
PROVENANCE = Path("results/profile/provenance.json")
BENCHMARKS = Path("benchmarks")


def read_benchmarks(directory: Path) -> pd.DataFrame:
    """One row per rule from benchmarks/<rule>.tsv: wall (s), CPU (cpu_time), peak RSS."""
    rows = []
    for path in sorted((directory / BENCHMARKS).glob("*.tsv")):
        table = pd.read_csv(path, sep="\t")
        if table.empty or not {"s", "cpu_time"} <= set(table.columns):
            raise ValueError(f"{path}: expected Snakemake benchmark columns s and cpu_time")
        last = table.iloc[-1]  # a rule benchmarked with repeat() has one row per repeat
        rows.append(
            {
                "rule": path.stem,
                "wall_s": float(last["s"]),
                "cpu_s": float(last["cpu_time"]),
                "max_rss_mb": float(last.get("max_rss", float("nan"))),
            }
        )
    return pd.DataFrame(rows, columns=["rule", "wall_s", "cpu_s", "max_rss_mb"])


def format_table(rules: pd.DataFrame, total_wall_s: float | None) -> str:
    """The per-rule table, slowest first, with sums and the run's own wall time."""
    rules = rules.sort_values("wall_s", ascending=False)
    lines = [f"{'rule':<16}{'wall s':>9}{'cpu s':>9}{'cpu/wall':>9}{'rss MB':>9}"]
    for row in rules.itertuples():
        ratio = row.cpu_s / row.wall_s if row.wall_s > 0 else float("nan")
        lines.append(
            f"{row.rule:<16}{row.wall_s:9.1f}{row.cpu_s:9.1f}{ratio:9.2f}{row.max_rss_mb:9.0f}"
        )
    lines.append(f"{'sum of rules':<16}{rules['wall_s'].sum():9.1f}{rules['cpu_s'].sum():9.1f}")
    if total_wall_s is not None:
        verdict = "within" if total_wall_s <= BUDGET_S else "OVER"
        lines.append(
            f"{'whole run':<16}{total_wall_s:9.1f}   ({verdict} the {BUDGET_S:.0f} s budget; "
            "rules overlap on several cores; rules without benchmark: are not listed)"
        )
    return "\n".join(lines)


def profile_dtype(directory: Path) -> str:
    path = directory / PROVENANCE
    if not path.exists():
        return "profile: no provenance.json"
    provenance = json.loads(path.read_text())
    return f"profile dtype {provenance.get('dtype')}: {provenance.get('dtype_reason', 'no reason')}"


def machine_speed_s(repeats: int = 5) -> float:
    """Median seconds of a fixed one-thread float32 workload (matmuls and a Python loop): the
    same before and after a run on a steady machine. Shared 2-core hosts drift by a third within
    minutes, so a run's rule times are read beside it, not against another day's."""
    import statistics

    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(384, 384, generator=generator)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(200):
            a = torch.tanh(a @ a)
        sum(i * i for i in range(1_000_000))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_cold(directory: Path, cores: int, configfile: str | None = None) -> float:
    """`snakemake --cores N report` in a fresh copy of the workflow; its wall seconds."""
    copy_workflow(directory)
    env = dict(os.environ)
    # the copy's own package, not an installed one from another checkout
    env["PYTHONPATH"] = os.pathsep.join(
        [str(directory / "scripts"), *filter(None, [env.get("PYTHONPATH")])]
    )
    extra = ["--configfile", configfile] if configfile else []
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", TARGET, "--cores", str(cores), *extra],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    (directory / "snakemake-run.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        sys.exit(
            f"snakemake failed (exit {run.returncode}) after {wall:.0f} s; its log: "
            f"{directory / 'snakemake-run.log'} (rule logs under {directory / 'logs'})"
        )
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument(
        "--configfile", help="merged over config/config.yaml, e.g. config/trainer.yaml"
    )
    parser.add_argument(
        "--directory", type=Path, help="read the benchmarks of a run already made there"
    )
    args = parser.parse_args()

    load_before = os.getloadavg()
    speed = [machine_speed_s()]
    if args.directory is not None:
        directory, total = args.directory, None
    else:
        directory = Path(tempfile.mkdtemp(prefix="probes-default-run-"))
        total = run_cold(directory, args.cores, args.configfile)
        speed.append(machine_speed_s())
    rules = read_benchmarks(directory)
    if rules.empty:
        sys.exit(f"no benchmark files under {directory / BENCHMARKS}")
    configfile = f" --configfile {args.configfile}" if args.configfile else ""
    print(f"cold default run: snakemake --cores {args.cores} {TARGET}{configfile} in {directory}")
    print(
        f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
        f"(on {os.cpu_count()} CPUs)"
    )
    print(
        "machine speed (a fixed one-thread workload, s; lower is faster): "
        + " before, ".join(f"{s:.3f}" for s in speed)
        + (" after" if len(speed) > 1 else " now")
    )
    print(profile_dtype(directory))
    print(format_table(rules, total))
    if args.directory is None and not args.keep:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
