"""The trainer bench's step timed after the mask gate in the same process, against without it:
page faults and seconds per micro-batch of 4 x 256 and 2 x 256 (the bench factory's
SFTTrainer, float32, one thread). Run from the repository root:

    python docs/evidence/cpu-xeon-amx-2026-12-05-allocator/faults.py --gate in-process
    python docs/evidence/cpu-xeon-amx-2026-12-05-allocator/faults.py --gate none
"""

import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench")
sys.path.insert(0, "scripts")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import realized_vs_promised as rv  # noqa: E402
from realized_setup import build_model, load_subset  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    gate = sys.argv[sys.argv.index("--gate") + 1]
    sys.argv = [sys.argv[0], "--trainer", "sft"]  # the bench's defaults otherwise
    args = rv.parse_args("faults")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp())
    examples = load_subset(args.lengths, args.examples, args.cap, args.seed)
    rv.trainer_examples(work, examples, args)
    if gate == "in-process":  # what the bench did before f079355
        model_dir = work / "model"
        build_model(args.cap, args.hidden).save_pretrained(model_dir)
        rv.gate_json(model_dir, args)
    from probes.step.factory import build_trainer, load_factory

    trainer = build_trainer(load_factory(rv.FACTORY), {"output_dir": str(work / "t")})
    trainer.create_optimizer_and_scheduler(num_training_steps=100)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.grad_accum
    data, collate = trainer.train_dataset, trainer.data_collator
    lengths = np.array([len(r["input_ids"]) for r in data])
    longest = np.flatnonzero(lengths >= 250)
    rng = np.random.default_rng(0)
    batches = {
        rows: collate([data[int(i)] for i in rng.choice(longest, rows)]) for rows in (4, 2)
    }
    seen = {rows: ([], []) for rows in batches}
    for repeat in range(18):
        for rows, batch in batches.items():
            before, start = faults(), time.perf_counter()
            trainer.training_step(trainer.model, batch, None)
            if repeat >= 3:  # the first three warm up
                seen[rows][0].append(time.perf_counter() - start)
                seen[rows][1].append(faults() - before)
        trainer.optimizer.step()
        trainer.model.zero_grad()
    medians = {rows: (statistics.median(t), statistics.median(f)) for rows, (t, f) in seen.items()}
    ratio = medians[4][0] / (2 * medians[2][0])
    print(json.dumps({"gate": gate, "per_micro_batch": medians, "4x256 / 2 x (2x256)": ratio}))


if __name__ == "__main__":
    main()
