"""Simulated default-run races: the real plans, a known cost, unit noise; final widths."""
import os, sys, numpy as np, pandas as pd
sys.path.insert(0, sys.argv[1])
from probes.replay.coverage import SimulatedCost
from probes.replay.sequential import build_design, run_sequential
from probes.replay.timing import ReplaySettings
plans = pd.read_parquet(os.environ.get('PLANS', 'results/profile/replay_plans.parquet'))
plans = plans[~plans.strategy.str.contains(r'\+')].drop(columns=['stratum', 'paired'])
FACT = {'gradient_checkpointing_on': 1.3, 'attention_eager': 0.97, 'loss_dft': 1.0}
UNIT_NOISE = float(sys.argv[2])

class Runner:
    import torch
    device = torch.device('cpu'); repeats = 1; reduce = staticmethod(np.median)
    def __init__(self, cost, cv, clock, seed):
        self.cost, self.cv, self.clock = cost, cv, clock
        self.rng = np.random.default_rng(seed)
    def warm_up(self, row): pass
    def warm_new_shapes(self, sample): return 0
    def time_micro_batch(self, row, busy=False):
        frame = pd.DataFrame([row._asdict()])
        base = float(self.cost.micro_batch_s(frame)[0]) * FACT.get(row.strategy, 1.0)
        # 0.25 s fixed: the default trainer's micro-batch on CPU is mostly fixed cost
        s = (0.25 + base) * max(1 + self.cv * self.rng.standard_normal(), 0.3)
        if self.rng.random() < 0.03: s *= 1 + self.rng.uniform(0.1, 0.4)
        self.clock[0] += s
        return {'status': 'OK', 'time_s': s, 'times_s': [s], 'gpu_busy_share': np.nan}
    def time_optimizer_step(self):
        self.clock[0] += 0.05; return 0.05

cost = SimulatedCost.scaled_to(plans)
out = []
for seed in range(int(sys.argv[3])):
    design = build_design(plans, int(os.environ.get('STRATA', 3)), seed=seed)
    clock = [0.0]
    settings = ReplaySettings(3, 6, 100, 8, seed=seed, warmup=0, busy_samples_per_stratum=0)
    r = run_sequential(Runner(cost, UNIT_NOISE, clock, seed), design, settings, list(design.strategies),
                       0.02, 4.0, float(sys.argv[4]), 0, 12, clock=lambda: clock[0])
    w = {n: 100 * (e.saving_high - e.saving_low) for n, e in r.estimates.items() if n != 'random'}
    out.append((max(w.values()), sum(v > 20 for v in w.values()), len(r.steps), r.record['rounds']))
a = np.array(out)
print(f'max width median {np.median(a[:,0]):.1f} mean #>20pp {a[:,1].mean():.2f}  runs with all<=20: {(a[:,1]==0).mean():.2f} units {a[:,2].mean():.0f} rounds {a[:,3].mean():.1f}')
