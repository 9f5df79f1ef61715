"""Benchmark: the replay on a harness of exactly known cost, C + K·rows·T per micro-batch.

The busy-wait harness of probes.step.synthetic spins the known cost of each micro-batch's shape
(rows × T; a packed micro-batch is one flattened row), here with its quadratic term off
(a = 0), through the replay's own sampling, timing path and model-assisted estimator on the
default run's plans (rebuilt as the stage rebuilds them, capped on CPU). For every strategy it
prints the exact saving against random (over the whole plan), the exact saving with the timing
path's measured per-call overhead added (what the busy-wait really costs: its Python calls and
the timer, ~tens of µs per micro-batch), the estimate, its 95% interval and whether each lies
inside. Repeated `--reps` times, since one run is one draw.

    python bench/replay_known_cost.py [--results results] [--reps 3]

Needs a finished `snakemake bucket_sweep` (the plans). No timing is asserted.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.config import load_config  # noqa: E402
from probes.replay import prepare as replay_prepare  # noqa: E402
from probes.replay.control import run_synthetic_control  # noqa: E402
from probes.settings import WorkflowConfig  # noqa: E402
from probes.step.synthetic import SyntheticCost  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    config = WorkflowConfig.from_dict(load_config())
    results = args.results
    inputs = {
        "plans": results / "bucket" / "plans.parquet",
        "lengths": results / "padding" / "lengths.parquet",
        "recommendation": results / "bucket" / "recommendation.json",
    }
    if not inputs["plans"].exists():
        sys.exit(f"{inputs['plans']}: missing; run `snakemake --cores 2 bucket_sweep` first")
    replay_cfg, training = config.replay, config.training
    plans, max_len = replay_prepare.plans_for_device(
        inputs, training, True, int(replay_cfg.cpu.max_seq_len)
    )
    fit_lengths = replay_prepare.fit_lengths_for(plans, replay_cfg, max_len, True)
    cost = dataclasses.replace(SyntheticCost.scaled_to(plans, linear_s=0.006), a=0.0)
    settings = replay_prepare.control_settings(replay_cfg, int(training.grad_accum))
    print(
        f"known cost per micro-batch: C = {cost.c * 1e3:.2f} ms + K = {cost.b * 1e6:.2f} µs "
        f"× rows·T; optimizer step {cost.optimizer_s * 1e3:.1f} ms; "
        f"{settings.n_strata} strata × {settings.samples_per_stratum} per strategy"
    )
    inside = outside = 0
    for rep in range(args.reps):
        control = run_synthetic_control(
            plans,
            dataclasses.replace(settings, seed=settings.seed + rep),
            fit_lengths,
            int(training["micro_batch_size"]),
            fit_repeats=3,
            cost=cost,
            repeats=int(replay_cfg["control"]["repeats"]),
        )
        overhead = control["observed"]["timing_overhead_s"]
        print(
            f"\nrun {rep + 1}: timing overhead {overhead['micro_batch'] * 1e6:.0f} µs per "
            f"micro-batch, {overhead['optimizer_step'] * 1e6:.0f} µs per optimizer step"
        )
        print(
            f"{'strategy':<20} {'exact':>8} {'+overhead':>10} {'estimate':>9} "
            f"{'95% interval':>20} {'inside':>7} {'+ovh inside':>12}"
        )
        for name, row in control["observed"]["strategies"].items():
            if name == "random":
                continue
            low, high = row["saving_ci"]
            ok = row["exact_saving_with_overhead_inside_interval"]
            inside, outside = inside + ok, outside + (not ok)
            print(
                f"{name:<20} {100 * row['exact_saving']:>+7.2f}% "
                f"{100 * row['exact_saving_with_overhead']:>+9.2f}% "
                f"{100 * row['estimated_saving']:>+8.2f}% "
                f"[{100 * low:>+7.2f}, {100 * high:>+7.2f}]% "
                f"{str(row['exact_saving_inside_interval']):>7} {str(ok):>12}"
            )
    print(
        f"\nexact saving (with the measured overhead) inside its interval: {inside} of "
        f"{inside + outside}"
    )


if __name__ == "__main__":
    main()
