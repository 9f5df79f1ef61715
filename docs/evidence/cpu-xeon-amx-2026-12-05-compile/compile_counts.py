"""Where a compiled SFTTrainer epoch spends its extra seconds: the process's first-compile probe
(probes.step.cold.first_compile), one eager bench epoch, then one with torch_compile=True from
empty caches, with torch's own counters and compile times over it (graphs, graph breaks,
frames compiled and recompiled, their compile seconds), to set beside the replay's record."""
import json, os, sys, tempfile, time
from pathlib import Path
sys.argv = ["bench", "--trainer", "sft", "--examples", "100", "--changes", "torch_compile"]
sys.path.insert(0, "bench")
import realized_vs_promised as rv  # noqa: E402
import torch  # noqa: E402
from probes.step import cold, compile as cp  # noqa: E402
from torch._dynamo.utils import get_compilation_metrics  # noqa: E402

torch.set_num_threads(1)
args = rv.parse_args()
examples = rv.load_subset(args.lengths, args.examples, args.cap, args.seed)


def counted(fn):
    before, metrics0 = cp.dynamo_counts(), list(get_compilation_metrics())
    begin = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - begin
    after = cp.dynamo_counts()
    new = [m for m in get_compilation_metrics() if not any(m is b for b in metrics0)]
    graphs, breaks, recompiled = after.since(before)
    return out, {
        "wall_s": round(wall, 1), "graphs": graphs, "graph_breaks": breaks,
        "frames_compiled": len(new), "frames_recompiled": recompiled,
        "frame_compile_s": round(sum(m.entire_frame_compile_time_s or 0 for m in new), 1),
        "co_names": sorted({str(m.co_name) for m in new}), "load": os.getloadavg()[0],
    }


with tempfile.TemporaryDirectory() as tmp:
    rv.trainer_examples(Path(tmp), examples, args)
    print(json.dumps({"first_compile": cold.first_compile().__dict__}), flush=True)
    rv.run_trainer_epoch({})
    base, _ = counted(lambda: rv.run_trainer_epoch({}))
    print(json.dumps({"eager_epoch": base}), flush=True)
    run, counts = counted(lambda: rv.run_trainer_epoch({"torch_compile": True}))
    print(json.dumps({"compiled_epoch": run, **counts}), flush=True)
