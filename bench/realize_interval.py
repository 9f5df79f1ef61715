"""Benchmark: do realize's few-step intervals cover, on real timings? From one realize run that
timed many steps per strategy (e.g. ``--set realize.cpu_sample_steps=12``), every way of drawing
``--draw`` of them per strategy is estimated as the stage estimates its own sample (the
promise-assisted ratio, the residual pooled over strategies:
probes.realize.estimate.epoch_estimates)
and, beside it, as it did before this wave (the ratio to each step's size, its own residuals).
Prints, for each, the share of drawn saving intervals that hold the saving estimated from all the
timed steps, and their median width; the all-steps saving carries its own error (about
``draw / timed`` of the drawn variance), so a share well under 0.95 is a failure, one at 0.95 a
pass.

    python scripts/run_realize.py --results R --set realize.cpu_sample_steps=12 \
        --set realize.cpu_budget_s=0 --allow-config-mismatch
    python bench/realize_interval.py --results R [--draw 2]

No timing is asserted; widths are in percentage points.
"""

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.contracts import RANDOM  # noqa: E402
from probes.realize import sample as sm  # noqa: E402
from probes.realize.estimate import epoch_estimates, step_auxiliaries  # noqa: E402
from probes.realize.promise import step_promises  # noqa: E402


def capped_plans(results: Path) -> pd.DataFrame:
    from probes.config import load_config
    from probes.replay.prepare import plans_for_device
    from probes.settings import WorkflowConfig

    config = WorkflowConfig.from_dict(load_config())
    inputs = {
        "plans": results / "bucket" / "plans.parquet",
        "lengths": results / "padding" / "lengths.parquet",
        "recommendation": results / "bucket" / "recommendation.json",
    }
    cap = int(config.replay.cpu.max_seq_len)
    return plans_for_device(inputs, config.training, True, cap)[0]


def draws(steps: pd.DataFrame, k: int, limit: int, rng: np.random.Generator):
    """Up to `limit` draws of `k` timed steps per strategy (every combination when fewer)."""
    per = {n: list(g.index) for n, g in steps.groupby("strategy")}
    combos = {n: list(itertools.combinations(ix, k)) for n, ix in per.items()}
    every = list(itertools.product(*combos.values()))
    if len(every) > limit:
        every = [every[i] for i in rng.choice(len(every), limit, replace=False)]
    for picked in every:
        yield steps.loc[[i for part in picked for i in part]]


def saving(estimates, name):
    return sm.saving_estimate(estimates[name][0], estimates[RANDOM][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--draw", type=int, default=2)
    parser.add_argument("--limit", type=int, default=2000)
    args = parser.parse_args()
    steps = pd.read_parquet(args.results / "realize" / "steps.parquet")
    steps = steps[steps["status"] == "OK"].reset_index(drop=True)
    plans = capped_plans(args.results)
    plans = plans[plans["strategy"].isin(steps["strategy"].unique())]
    units = pd.read_parquet(args.results / "profile" / "replay_steps.parquet")
    auxiliaries = {
        "promise, pooled (now)": step_auxiliaries(plans, step_promises(plans, units)),
        "step size, own (before)": step_auxiliaries(plans, None),
    }
    counts = steps.groupby("strategy").size().to_dict()
    print(f"timed steps per strategy: {counts}; draws of {args.draw} per strategy")
    for label, aux in auxiliaries.items():
        own = label.endswith("(before)")

        def estimate(part, aux=aux, own=own):
            if own:  # the estimator before: one ratio on the whole step, its own residuals
                return {
                    n: (
                        sm.epoch_estimate(
                            g["time_s"], len(aux[n]), aux[n].loc[g["optimizer_step_index"]], aux[n]
                        ),
                        None,
                    )
                    for n, g in part.groupby("strategy")
                }
            return epoch_estimates(part, aux)

        full = estimate(steps)
        for name in full:
            if name == RANDOM:
                continue
            truth = saving(full, name)[0]
            hits, widths = 0, []
            for part in draws(steps, args.draw, args.limit, np.random.default_rng(0)):
                _, low, high = saving(estimate(part), name)
                hits += low <= truth <= high
                widths.append(100 * (high - low))
            print(
                f"{label:<26}{name:<18} all steps {100 * truth:+.1f}%  "
                f"covered {hits / len(widths):.3f} of {len(widths)}  "
                f"median width {np.median(widths):.1f} pp"
            )


if __name__ == "__main__":
    main()
