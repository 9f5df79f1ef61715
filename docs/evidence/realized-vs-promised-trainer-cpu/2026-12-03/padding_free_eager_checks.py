"""padding_free_eager against its promise: two in-process checks on the bench factory's trainer.

The bench's trainer-mode tables (beside this file) realized padding_free_eager slower than
promised in each run. Both checks build the bench factory's SFTTrainer as the bench does (its
subset, model and settings), on one thread, as the bench:

- ``census``: 3 rounds in alternating order, the baseline's and the change's epochs through
  ``trainer.train()`` (the bench's run_trainer_epoch: train_runtime), and the census of each
  one's own dataloader through ``training_step`` (every micro-batch; 3 untimed first).
- ``cold-shapes``: does a new shape's first run (which the replay warms away, and which the
  change's flattened rows meet often) explain it? Every micro-batch of each dataloader through
  ``training_step``, three passes: the first meets each shape cold, the next two warm. Twice,
  alternating.
- ``back-to-back``: the replay times a micro-batch right after an untimed run of itself (its
  shape's warm-up); training runs one different micro-batch after another. Every micro-batch of
  each dataloader both ways (3 untimed first). Twice, alternating.

- ``after-switch``: the replay interleaves strategies, so a baseline unit often runs right after
  a unit of another configuration. 80 baseline micro-batches on the replay's own step (the base
  trainer, switched as the replay switches it): in sequence, each right after an eager
  padding-free unit (switched there and back), each right after a baseline unit. Twice.

    python padding_free_eager_checks.py {census,cold-shapes,back-to-back,after-switch} LENGTHS REC
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "scripts")]

import numpy as np  # noqa: E402
import realized_vs_promised as rvp  # noqa: E402
import torch  # noqa: E402

from probes.step.factory import build_trainer, load_factory  # noqa: E402
from probes.step.trainer import loss_items  # noqa: E402

CHANGE = {  # padding_free_eager's settings, as recommendations.json emits them
    "padding_free": True,
    "max_length": None,
    "drop_no_loss_examples": True,
    "attn_implementation": "eager",
}


def bench_factory(lengths: str, recommendation: str) -> tuple:
    """The bench's subset written where its factory reads it; the factory and a scratch dir."""
    sys.argv = ["x", "--trainer", "sft", "--lengths", lengths, "--recommendation", recommendation]
    args = rvp.parse_args()
    work = Path(tempfile.mkdtemp())
    examples = rvp.load_subset(args.lengths, args.examples, args.cap, args.seed)
    rvp.trainer_examples(work, examples, args)
    return load_factory(rvp.FACTORY), work


def timed_passes(factory, work: Path, settings: dict, passes: int, untimed: int = 0) -> tuple:
    """Micro-batches, distinct shapes and the seconds of each pass over the trainer's own
    dataloader through training_step."""
    trainer = build_trainer(factory, {"output_dir": str(work / "c"), **settings})
    batches = list(trainer.get_train_dataloader())
    trainer.model.train()
    for batch in batches[:untimed]:
        trainer.training_step(trainer.model, batch, loss_items(batch))
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        for batch in batches:
            trainer.training_step(trainer.model, batch, loss_items(batch))
        seconds.append(time.perf_counter() - start)
    shapes = {tuple(b["input_ids"].shape) for b in batches}
    return len(batches), len(shapes), seconds


def census(factory, work: Path) -> None:
    res: dict[str, list[float]] = {}
    for rnd in range(3):
        order = [("R", {}), ("B", CHANGE)] if rnd % 2 == 0 else [("B", CHANGE), ("R", {})]
        for name, settings in order:
            epoch = rvp.run_trainer_epoch(settings)["train_runtime"]
            res.setdefault(name + "_epoch", []).append(epoch)
            res.setdefault(name + "_census", []).append(
                timed_passes(factory, work, settings, 1, untimed=3)[2][0]
            )
        print(rnd, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    m = {k: float(np.mean(v)) for k, v in res.items()}
    print("epoch saving", 1 - m["B_epoch"] / m["R_epoch"],
          "census saving", 1 - m["B_census"] / m["R_census"])  # fmt: skip
    for kind in ("epoch", "census"):
        pairs = zip(res[f"B_{kind}"], res[f"R_{kind}"], strict=True)
        print(f"per-round {kind}", [round(1 - b / r, 3) for b, r in pairs])


def cold_shapes(factory, work: Path) -> None:
    for name, settings in [("R", {}), ("B", CHANGE), ("R", {}), ("B", CHANGE)]:
        n, k, seconds = timed_passes(factory, work, settings, 3)
        passes = [round(x, 2) for x in seconds]
        print(name, "micro-batches", n, "distinct shapes", k, "pass s (first cold, then warm):",
              passes, flush=True)  # fmt: skip


def back_to_back(factory, work: Path) -> None:
    for name, settings in [("R", {}), ("B", CHANGE), ("R", {}), ("B", CHANGE)]:
        trainer = build_trainer(factory, {"output_dir": str(work / "c"), **settings})
        batches = list(trainer.get_train_dataloader())
        trainer.model.train()

        def step(batch, trainer=trainer):
            trainer.training_step(trainer.model, batch, loss_items(batch))

        for batch in batches[:3]:
            step(batch)
        start = time.perf_counter()
        for batch in batches:
            step(batch)
        in_sequence = time.perf_counter() - start
        warmed = 0.0
        for batch in batches:
            step(batch)
            start = time.perf_counter()
            step(batch)
            warmed += time.perf_counter() - start
        print(name, "in sequence", round(in_sequence, 2), "back to back", round(warmed, 2),
              "ratio", round(warmed / in_sequence, 3), flush=True)  # fmt: skip


def after_switch(factory, work: Path) -> None:
    from probes.step.changes import StepConfig, apply_config
    from probes.step.trainer import TrainerStep, probe_settings

    settings = probe_settings(str(work / "a"), torch.device("cpu"), torch.float32, 256, 0)
    base = TrainerStep(build_trainer(factory, settings), factory, 256)
    trainer = base.trainer
    batches = list(trainer.get_train_dataloader())[:80]
    flat = [base.flat_collator([base.dataset[i] for i in (2 * k, 2 * k + 1)]) for k in range(80)]
    sdpa, eager = StepConfig(False, "sdpa"), StepConfig(False, "eager")

    def step(batch):
        trainer.training_step(trainer.model, batch, loss_items(batch))

    def timed(batch) -> float:
        start = time.perf_counter()
        step(batch)
        return time.perf_counter() - start

    apply_config(base.model, sdpa, trainer.args)
    for batch in batches[:3]:
        step(batch)
    for _ in range(2):
        in_sequence = sum(timed(b) for b in batches)
        switched = 0.0
        for batch, other in zip(batches, flat, strict=True):
            apply_config(base.model, eager, trainer.args)
            step(other)
            apply_config(base.model, sdpa, trainer.args)
            switched += timed(batch)
        same = 0.0
        for batch in batches:
            step(batches[0])
            same += timed(batch)
        print("random units: in sequence", round(in_sequence, 3),
              "each after an eager padding-free unit", round(switched, 3),
              "each after a random unit", round(same, 3), flush=True)  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    check, lengths, recommendation = sys.argv[1:4]
    factory, work = bench_factory(lengths, recommendation)
    checks = {
        "census": census,
        "cold-shapes": cold_shapes,
        "back-to-back": back_to_back,
        "after-switch": after_switch,
    }
    checks[check](factory, work)
