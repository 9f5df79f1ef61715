"""padding_free_eager: its realized epoch against the census of its training steps, in one process.

The bench's 3-round table (table-3-rounds.md) realized -23.4% against a promised -13.5%
[-18.6%, -8.4%]. This builds the bench factory's SFTTrainer as the bench does, then, 3 rounds in
alternating order: one epoch of the baseline and of padding_free_eager through trainer.train()
(the bench's run_trainer_epoch: train_runtime), and the census: every micro-batch of each one's
own dataloader through training_step (3 untimed first). One thread, as the bench.

    python padding_free_eager_census.py LENGTHS.parquet RECOMMENDATION.json
"""

import sys, time, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "bench")); sys.path.insert(0, str(REPO / "scripts"))
import torch, numpy as np
torch.set_num_threads(1)
import realized_vs_promised as rvp
from probes.step.trainer import loss_items
sys.argv = ["x", "--trainer", "sft", "--lengths", sys.argv[1], "--recommendation", sys.argv[2]]
args = rvp.parse_args()
work = Path(tempfile.mkdtemp())
examples = rvp.load_subset(args.lengths, args.examples, args.cap, args.seed)
rvp.trainer_examples(work, examples, args)
from probes.step.factory import build_trainer, load_factory
fac = load_factory(rvp.FACTORY)
pf = {"padding_free": True, "max_length": None, "drop_no_loss_examples": True, "attn_implementation": "eager"}
def census(settings):
    tr = build_trainer(fac, {"output_dir": str(work / "c"), **settings})
    batches = list(tr.get_train_dataloader())
    tr.model.train()
    for b in batches[:3]:
        tr.training_step(tr.model, b, loss_items(b))
    t = time.perf_counter()
    for b in batches:
        tr.training_step(tr.model, b, loss_items(b))
    return time.perf_counter() - t
res = {}
for rnd in range(3):
    order = [("R", {}), ("B", pf)] if rnd % 2 == 0 else [("B", pf), ("R", {})]
    for name, s in order:
        res.setdefault(name + "_epoch", []).append(rvp.run_trainer_epoch(s)["train_runtime"])
        res.setdefault(name + "_census", []).append(census(s))
    print(rnd, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
m = {k: float(np.mean(v)) for k, v in res.items()}
print("epoch saving", 1 - m["B_epoch"] / m["R_epoch"], "census saving", 1 - m["B_census"] / m["R_census"])
print("per-round epoch", [round(1 - b / r, 3) for b, r in zip(res["B_epoch"], res["R_epoch"])])
print("per-round census", [round(1 - b / r, 3) for b, r in zip(res["B_census"], res["R_census"])])
