import os, sys, math, numpy as np, pandas as pd
sys.path.insert(0, sys.argv[1])
import probes.replay.sequential as sq
from probes.replay.timing import MICRO_BATCH
from probes.batching import plans as pl
exec(open(os.path.join(os.path.dirname(__file__), 'race.py')).read().split("cost = SimulatedCost")[0].split("from probes.replay.timing import ReplaySettings")[1])
from probes.replay.timing import ReplaySettings
from probes.replay.coverage import SimulatedCost
from probes.replay.sequential import build_design, run_sequential
CLOCK = [0.0]; BUDGET = float(sys.argv[4])
orig = sq.next_takes
def triaged(design, done, estimates, steps, cv, undecided, round_size):
    ok = steps[(steps["kind"] == MICRO_BATCH) & (steps["status"] == "OK")]
    unit_s = ok.groupby("strategy")["time_s"].mean().to_dict(); counts = ok.groupby("strategy").size().to_dict()
    need = {}
    for n in undecided:
        e = estimates.get(n)
        if e is None or not math.isfinite(e.saving_high - e.saving_low): need[n] = 0.0; continue
        half = 0.5 * (e.saving_high - e.saving_low); centre = abs(0.5 * (e.saving_high + e.saving_low))
        target = min(max(centre, 0.05 - centre, 1e-3), 0.1)
        c = counts.get(n, 1); more = max(math.ceil(c * (half / target) ** 2) - c, 1)
        need[n] = more * (unit_s.get(n, 0) + unit_s.get(pl.BASELINE, 0))
    remaining = BUDGET - CLOCK[0]
    keep, spent = [], 0.0
    for n in sorted(undecided, key=lambda n: need[n]):
        if not keep or spent + need[n] <= remaining:
            keep.append(n); spent += need[n]
    return orig(design, done, estimates, steps, cv, keep, round_size)
if sys.argv[5] == 'triage': sq.next_takes = triaged
cost = SimulatedCost.scaled_to(plans)
out = []
for seed in range(int(sys.argv[3])):
    design = build_design(plans, 3, seed=seed)
    CLOCK[0] = 0.0
    settings = ReplaySettings(3, 6, 100, 8, seed=seed, warmup=0, busy_samples_per_stratum=0)
    r = run_sequential(Runner(cost, UNIT_NOISE, CLOCK, seed), design, settings, list(design.strategies),
                       0.02, 4.0, BUDGET, 0, 12, clock=lambda: CLOCK[0])
    w = {n: 100 * (e.saving_high - e.saving_low) for n, e in r.estimates.items() if n != 'random'}
    out.append((max(w.values()), sum(v > 20 for v in w.values()), len(r.steps), r.record['rounds']))
a = np.array(out)
print(f'{sys.argv[5]} noise {UNIT_NOISE}: max width median {np.median(a[:,0]):.1f} mean #>20pp {a[:,1].mean():.2f}  all<=20: {(a[:,1]==0).mean():.2f} units {a[:,2].mean():.0f} rounds {a[:,3].mean():.1f}')
