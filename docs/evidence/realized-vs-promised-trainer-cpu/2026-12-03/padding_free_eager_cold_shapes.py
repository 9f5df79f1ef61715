"""padding_free_eager: does a new shape's first run (which the replay warms away) explain its
realized epochs running slower than promised? Every micro-batch of the baseline's and the
change's own dataloaders through training_step, three passes in one process: the first pass
meets each shape cold, the next two warm. Twice, alternating. One thread, as the bench.

    python padding_free_eager_cold_shapes.py LENGTHS.parquet RECOMMENDATION.json
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
def passes(settings):
    tr = build_trainer(fac, {"output_dir": str(work / "c"), **settings})
    batches = list(tr.get_train_dataloader())
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    tr.model.train()
    out = []
    for p in range(3):
        t = time.perf_counter()
        for b in batches:
            tr.training_step(tr.model, b, loss_items(b))
        out.append(time.perf_counter() - t)
    return len(batches), len(shapes), out
for name, s in [("R", {}), ("B", pf), ("R", {}), ("B", pf)]:
    n, k, out = passes(s)
    print(name, "micro-batches", n, "distinct shapes", k, "pass s (first cold, then warm):", [round(x, 2) for x in out], flush=True)
