"""Benchmark: today's stratified estimator against the model-assisted (GREG) one, on the same
timed sample; prints each strategy's 95% saving-interval width under both and their ratio.

Two samples:

- ``real``: the replay's own timed micro-batches (``results/profile/replay_steps.parquet``) and
  the plans it replayed (rebuilt as the stage does, capped on CPU), when a run left them;
- ``simulated``: synthetic plans at the default CPU shape (64-token cap, micro-batch 2), timed by
  a known cost (probes.replay.control.SimulatedCost: shape, loss tokens and terms the working
  model lacks) with noise at ``--cv``, sampled with the stage's default design
  (3 strata × 2 + rounds of 12 up to ``--units``); here each estimator's coverage of the exact
  saving over ``--reps`` samples is printed too.

    python bench/replay_width.py [--results results] [--cv 0.1] [--units 72] [--reps 200]

No timing is asserted; widths are in percentage points.
"""

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.batching import plans as pl  # noqa: E402
from probes.replay import estimate as es  # noqa: E402
from probes.replay.control import SimulatedCost  # noqa: E402
from probes.replay.sequential import build_design, initial_takes, strategy_designs  # noqa: E402
from probes.replay.timing import MICRO_BATCH  # noqa: E402


def stratified_widths(design, steps, optimizer_times, resamples=2000, seed=1):
    """Today's estimator: Σ_h N_h ȳ_h with the joint percentile bootstrap."""
    per = {}
    for name in design.strategies:
        part = steps[steps["strategy"] == name]
        per[name] = es.strata_times(part, int(design.plans[name]["optimizer_step_index"].nunique()))
    estimates = es.estimate_all(per, optimizer_times, resamples, seed)
    base = estimates[pl.BASELINE]
    return {n: es.saving_interval(e, base) for n, e in estimates.items()}


def greg_widths(design, steps, optimizer_times, cv, cv_df=4.0):
    greg, _ = es.greg_estimate_all(strategy_designs(design, steps), optimizer_times, cv, cv_df)
    return {n: (e.saving, e.saving_low, e.saving_high) for n, e in greg.items()}


def table(old, new, exact=None):
    print(f"{'strategy':<22}{'today [pp]':>12}{'GREG [pp]':>12}{'ratio':>8}")
    for name in new:
        if name == pl.BASELINE:
            continue
        w_old = 100 * (old[name][2] - old[name][1])
        w_new = 100 * (new[name][2] - new[name][1])
        print(f"{name:<22}{w_old:>12.1f}{w_new:>12.1f}{w_new / w_old if w_old else math.nan:>8.2f}")


def real(results: Path) -> bool:
    steps_path = results / "profile" / "replay_steps.parquet"
    control_path = results / "profile" / "replay_control.json"
    if not steps_path.exists():
        print(f"real: no {steps_path}; run `snakemake --cores 2 replay` first")
        return False
    import json

    from probes.config import load_config
    from probes.replay.prepare import plans_for_device
    from probes.settings import WorkflowConfig

    config = WorkflowConfig.from_dict(load_config())
    steps = pd.read_parquet(steps_path)
    control = json.loads(control_path.read_text())
    cv = float(control.get("instrument", {}).get("cv") or 0.0)
    inputs = {
        "plans": results / "bucket" / "plans.parquet",
        "lengths": results / "padding" / "lengths.parquet",
        "recommendation": results / "bucket" / "recommendation.json",
    }
    cpu_only = (
        bool(steps.get("cpu_only", pd.Series([True])).iloc[0]) if "cpu_only" in steps else True
    )
    plans, _ = plans_for_device(
        inputs, config.training, cpu_only, int(config.replay.cpu.max_seq_len)
    )
    design = build_design(plans, int(config.replay.cpu.n_strata), int(config.replay.seed))
    micro = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == "OK")]
    optimizer = steps.loc[steps["kind"] == "optimizer_step", "time_s"].to_numpy(np.float64)
    print(f"real: {len(micro)} timed micro-batches, instrument CV {cv:.3f}")
    table(stratified_widths(design, micro, optimizer), greg_widths(design, micro, optimizer, cv))
    wall_time(results)
    return True


# The replay before this wave (stratified estimator, 72 micro-batches; commit 739c7fd) on the
# same 2-core AVX2 CPU, float32, and the same default plans: 164.5 s of stage wall time, widths
# 76-118 pp (docs/evidence/cpu-avx2-2026-12-01-replay/before_after.txt). The "~100 s"
# was a CPU with bf16 units.
BEFORE_WALL_S = 164.5


def wall_time(results: Path) -> None:
    """The replay rule's wall time (Snakemake's benchmark file beside `results`, else the
    replay's own provenance) against BEFORE_WALL_S."""
    tsv = results.parent / "benchmarks" / "replay.tsv"
    if tsv.exists():
        seconds, source = float(pd.read_csv(tsv, sep="\t")["s"].iloc[-1]), str(tsv)
    else:
        from probes.io import read_provenance

        seconds = float(read_provenance(results / "profile" / "replay.parquet")["wall_s"])
        source = "replay.parquet provenance wall_s"
    print(
        f"replay wall time: {seconds:.0f} s ({source}); before: ~{BEFORE_WALL_S:.0f} s; "
        f"ratio {seconds / BEFORE_WALL_S:.2f}"
    )


def simulated(cv: float, units: int, reps: int, seed: int = 0) -> None:
    from probes.bucket import control as bucket_controls
    from probes.contracts import TRAINING_STATUSES
    from probes.replay.strata import grow_allocation

    frame = bucket_controls.synthetic_lengths_frame(6000, seed=1, max_seq_len=64)
    used = frame[frame["status"].isin(TRAINING_STATUSES)]
    lengths = used["n_tokens"].to_numpy(np.int64)
    loss = np.where(np.arange(lengths.size) % 3 == 0, 0, lengths // 2)
    examples = pl.PlanExamples(used["example_id"].to_numpy(object), lengths, loss)
    plans = pl.build_plans(examples, 2, 4, 64, bucket_size_batches=16, seed=0)
    design = build_design(plans, 3, seed)
    cost = SimulatedCost.scaled_to(plans)
    takes = initial_takes(design, design.strategies, 0)
    spread = {k: 1.0 for k in design.sizes}
    totals = {n: float(cost.micro_batch_s(p).sum()) for n, p in design.plans.items()}
    from probes.replay.sequential import strategy_weights

    weights = strategy_weights(totals, design.strategies)
    for key in design.sizes:  # spread ∝ the stratum's mean cost (noise at a constant CV)
        name, h = key
        members = design.orders[name][h]
        spread[key] = cv * float(cost.micro_batch_s(design.plans[name].iloc[members]).mean())
    takes = grow_allocation(
        takes, design.sizes, spread, weights, max(units - sum(takes.values()), 0)
    )
    rng = np.random.default_rng(seed)
    mu = {n: cost.micro_batch_s(p) for n, p in design.plans.items()}
    steps_n = {n: int(p["optimizer_step_index"].nunique()) for n, p in design.plans.items()}
    exact = {n: mu[n].sum() + steps_n[n] * cost.optimizer_s for n in mu}
    exact_saving = {n: 1 - exact[n] / exact[pl.BASELINE] for n in exact}
    widths_old, widths_new, hit_old, hit_new = [], [], [], []
    for _ in range(reps):
        rows = []
        for (name, h), n in takes.items():
            picked = rng.choice(design.orders[name][h], size=n, replace=False)
            part = design.plans[name].iloc[picked].copy()
            part["stratum"], part["stratum_size"] = h, design.sizes[(name, h)]
            part["time_s"] = mu[name][picked] * (1 + cv * rng.standard_normal(n))
            rows.append(part)
        steps = pd.concat(rows, ignore_index=True)
        steps["kind"], steps["status"] = MICRO_BATCH, "OK"
        optimizer = cost.optimizer_s * (1 + cv * rng.standard_normal(20))
        old = stratified_widths(
            design, steps, optimizer, resamples=500, seed=int(rng.integers(1e9))
        )
        new = greg_widths(design, steps, optimizer, cv)
        names = [n for n in new if n != pl.BASELINE]
        widths_old.append([old[n][2] - old[n][1] for n in names])
        widths_new.append([new[n][2] - new[n][1] for n in names])
        hit_old.append([old[n][1] <= exact_saving[n] <= old[n][2] for n in names])
        hit_new.append([new[n][1] <= exact_saving[n] <= new[n][2] for n in names])
    w_old, w_new = 100 * np.mean(widths_old, axis=0), 100 * np.mean(widths_new, axis=0)
    c_old, c_new = np.mean(hit_old, axis=0), np.mean(hit_new, axis=0)
    print(f"simulated: CV {cv}, {sum(takes.values())} timed micro-batches, {reps} samples")
    head = f"{'strategy':<22}{'today [pp]':>12}{'GREG [pp]':>12}{'ratio':>8}"
    print(f"{head}{'cover today':>13}{'cover GREG':>12}")
    for i, name in enumerate(names):
        ratio = w_new[i] / w_old[i]
        print(
            f"{name:<22}{w_old[i]:>12.1f}{w_new[i]:>12.1f}{ratio:>8.2f}"
            f"{c_old[i]:>13.2f}{c_new[i]:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--cv", type=float, default=0.1)
    parser.add_argument("--units", type=int, default=72)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    real(args.results)
    print()
    simulated(args.cv, args.units, args.reps)


if __name__ == "__main__":
    main()
