"""Does the first compile in a process cost more than a later one from equally empty caches?"""
import sys, time, json, torch
sys.path.insert(0, "bench"); sys.path.insert(0, "scripts")
torch.set_num_threads(1)
from realized_setup import build_model
from probes.step.compile import fresh_compiles
m = build_model(256, 128).train()
def step(mod, n, rows=2):
    ids = torch.randint(1, 512, (rows, n))
    t = time.perf_counter(); mod(input_ids=ids, labels=ids).loss.backward(); m.zero_grad(); return time.perf_counter() - t
step(m, 100)
for attempt in range(3):
    with fresh_compiles():
        c = torch.compile(m)
        print(json.dumps({"attempt": attempt, "first_calls_s": [round(step(c, n, r), 2) for n, r in ((100, 2), (150, 2), (90, 1))]}), flush=True)
