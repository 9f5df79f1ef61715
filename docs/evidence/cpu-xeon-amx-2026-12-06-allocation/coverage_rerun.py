"""A run's coverage control simulated again from its replay_plans.parquet and replay_control.json:
`python coverage_rerun.py RUN_DIR STRATEGY[,...] [x]` (x: the whole control, 400 replications)."""
import json, sys, numpy as np, pandas as pd
sys.path.insert(0, 'scripts')  # run from the repository root; RUN_DIR holds replay_plans.parquet, replay_control.json
from probes.replay import sequential as sq
from probes.replay import coverage as cv_mod
from probes.replay.coverage import SimulatedCost, KnownPlans, simulated_estimates, SPIKE_SHARE
root = sys.argv[1]
plans = pd.read_parquet(f'{root}/replay_plans.parquet')
plans = plans[~plans.strategy.str.contains(r'\+')]
ctl = json.load(open(f'{root}/replay_control.json'))
frames, strata, orders, sizes = {}, {}, {}, {}
paired = set(plans.loc[plans.paired, 'strategy'])
for n, g in plans.groupby('strategy', sort=False):
    g = g.reset_index(drop=True); frames[n] = g; strata[n] = g.stratum.to_numpy()
    orders[n] = [np.flatnonzero(strata[n] == h) for h in range(strata[n].max() + 1)]
    for h, m in enumerate(orders[n]): sizes[(n, h)] = len(m)
d = sq.Design(frames, strata, {n: np.zeros((len(orders[n]), 2)) for n in frames}, orders, sizes, frozenset(paired))
takes = {(k.split('/')[0], int(k.split('/')[1])): v for k, v in ctl['stopping']['takes'].items() if '+' not in k}
obs = ctl['coverage']['observed']; exp = ctl['coverage']['expected']
cost = SimulatedCost.scaled_to(pd.concat(d.plans.values(), ignore_index=True))
factors = {n: 1.3 if n.startswith('gradient') else 1.0 for n in paired}
known = KnownPlans.of(d, cost, factors)
rng = np.random.default_rng(3)
names = sys.argv[2].split(',')
for spike in (SPIKE_SHARE, 0.0):
    W = {n: [] for n in names}
    for _ in range(200):
        est = simulated_estimates(d, known, takes, cost, (exp['cv'], spike, obs['unit_noise'], 12), rng)
        for n in names: W[n].append(100 * (est[n].saving_high - est[n].saving_low))
    for n in names:
        w = np.array(W[n]); print(f'spike {spike} {n}: mean {w.mean():.1f} median {np.median(w):.1f} p90 {np.percentile(w,90):.1f} share>20 {(w>20).mean():.2f}')
from probes.replay.coverage import run_coverage_control
if len(sys.argv) > 3:
    factors = {'gradient_checkpointing_on': 1.35, 'attention_eager': 0.9, 'loss_dft': 0.97}
    factors = {k: v for k, v in factors.items() if k in paired}
    r = run_coverage_control(d, takes, exp['cv'], 12, 400, 3, 0.9, max_width=0.2, factors=factors, unit_noise=obs['unit_noise'])
    o = r['observed']
    print(r['verdict'], {k: (o['coverage'][k], round(o['mean_width_pp'][k], 1), o['verdicts'][k]) for k in o['coverage']})
