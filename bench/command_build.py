"""What building the trainer through ``trainer.command`` costs beside ``trainer.factory``.

Every trainer stage (padding, profile, replay, realize) builds the trainer once in its own
process; the rest of each stage is the same for both sources. So the cold run's difference is
four builds' difference. This builds the embedded default's trainer through each source in a
fresh process (imports, model load, dataset preparation, as a stage does), alternating, and
prints each build's wall time, the medians, their ratio command / factory and the median of the
paired (same round) ratios. One build of each first is not counted: it tokenizes the data into
datasets' cache, which a cold run does once on either path (padding's build), not in every stage.

    python bench/command_build.py [--repeats 2] [--command-config config/command.yaml]

Needs resources/ materialised (snakemake default_model default_data default_assistant_data).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from probes.step.source import output_dir, trainer_source
from probes.step.trainer import probe_settings
source = trainer_source(json.loads(sys.argv[1]))
trainer = source.build(probe_settings(output_dir(), torch.device("cpu"), torch.float32, None, 0))
print(json.dumps({"seconds": time.perf_counter() - start, "rows": len(trainer.train_dataset),
                  "trainer": type(trainer).__name__}))
"""


def build_once(section: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(section)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"build failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--command-config", default="config/command.yaml")
    parser.add_argument("--factory-config", default="config/trainer.yaml")
    args = parser.parse_args()
    sources = {
        name: yaml.safe_load((REPO / path).read_text())["trainer"]
        for name, path in (("factory", args.factory_config), ("command", args.command_config))
    }
    times: dict[str, list[float]] = {name: [] for name in sources}
    for name, section in sources.items():
        print(
            f"{name:8s} warm-up (not counted): {build_once(section)['seconds']:.1f} s", flush=True
        )
    for repeat in range(args.repeats):
        for name, section in sources.items():
            result = build_once(section)
            times[name].append(result["seconds"])
            print(f"{name:8s} build {repeat + 1}: {result['seconds']:.1f} s", result, flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    paired = [c / f for c, f in zip(times["command"], times["factory"], strict=True)]
    ratio = medians["command"] / medians["factory"]
    print(
        json.dumps(
            {"median_s": medians, "ratio": ratio, "paired_median": statistics.median(paired)}
        )
    )


if __name__ == "__main__":
    main()
