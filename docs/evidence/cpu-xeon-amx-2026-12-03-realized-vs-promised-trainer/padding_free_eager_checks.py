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

- ``interleaved-vs-blocks``: the replay's step, 80 baseline and 80 flattened micro-batches timed
  interleaved and in blocks.
- ``replay-units``: one replay, then the census of its plan: the replay's sampled units against
  the same micro-batches in sequence, and the estimate from each (timing vs sample).
- ``switched-vs-own`` and ``sequence-context`` (on the plan a ``replay-units`` run kept, its
  directory as LENGTHS): the replay's switched step and collator against the change's own
  trainer; the collector off and interleaving against the census's sequence.

    python padding_free_eager_checks.py CHECK LENGTHS REC
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


def interleaved_vs_blocks(factory, work: Path) -> None:
    """The replay's step (the base trainer, switched per unit): 80 baseline micro-batches and
    the same 80 flattened (eager padding-free), timed interleaved (one of each in turn, as the
    replay orders units) and in blocks (all of one, then all of the other, as training runs
    them); the change's time over the baseline's each way. Three times, alternating."""
    from probes.step.changes import StepConfig, apply_config
    from probes.step.trainer import TrainerStep, probe_settings

    settings = probe_settings(str(work / "a"), torch.device("cpu"), torch.float32, 256, 0)
    base = TrainerStep(build_trainer(factory, settings), factory, 256)
    trainer = base.trainer
    batches = list(trainer.get_train_dataloader())[:80]
    flat = [base.flat_collator([base.dataset[i] for i in (2 * k, 2 * k + 1)]) for k in range(80)]
    configs = {"R": StepConfig(False, "sdpa"), "B": StepConfig(False, "eager")}

    def timed(name, batch) -> float:
        apply_config(base.model, configs[name], trainer.args)
        start = time.perf_counter()
        trainer.training_step(trainer.model, batch, loss_items(batch))
        return time.perf_counter() - start

    for name, batch in [("R", batches[0]), ("B", flat[0])] * 3:
        timed(name, batch)
    for _ in range(3):
        r = b = 0.0
        for batch, other in zip(batches, flat, strict=True):
            r += timed("R", batch)
            b += timed("B", other)
        blocks_r = sum(timed("R", batch) for batch in batches)
        blocks_b = sum(timed("B", other) for other in flat)
        print("interleaved: R", round(r, 3), "B", round(b, 3), "B/R", round(b / r, 3),
              "| blocks: R", round(blocks_r, 3), "B", round(blocks_b, 3),
              "B/R", round(blocks_b / blocks_r, 3), flush=True)  # fmt: skip


def replay_units(factory, work: Path) -> None:
    """Where the promise parts from the census: one replay through the bench (run_promised),
    then the census of every micro-batch of its random plan, padded on the baseline's trainer
    and flattened on the change's own (two passes in sequence, the median of each). For random
    and padding_free_eager it prints the replay's sampled units against the census of the same
    micro-batches (the timing), and the stratified expansion from the replay's unit times, from
    the census times of the same units, and the census total (the sample)."""
    import pandas as pd

    args = rvp.parse_args()
    examples = rvp.load_subset(args.lengths, args.examples, args.cap, args.seed)
    rec = rvp.json.loads(Path(args.recommendation).read_text())
    rvp.run_promised(work, examples, rec, args)
    base = build_trainer(factory, {"output_dir": str(work / "r")})
    own = build_trainer(factory, {"output_dir": str(work / "b"), **CHANGE})
    plan = pd.read_parquet(work / "plans.parquet")
    plan = plan[plan["strategy"] == "random"].reset_index(drop=True)
    items = [[base.train_dataset[int(i)] for i in ids] for ids in plan["example_ids"]]
    census = {}
    for name, trainer in (("random", base), ("padding_free_eager", own)):
        batches = [trainer.data_collator(rows) for rows in items]
        trainer.model.train()

        def timed(batch, trainer=trainer) -> float:
            start = time.perf_counter()
            trainer.training_step(trainer.model, batch, loss_items(batch))
            return time.perf_counter() - start

        for batch in batches[:3]:
            timed(batch)
        census[name] = np.median([[timed(b) for b in batches] for _ in range(2)], axis=0)
    position = {int(m): k for k, m in enumerate(plan["micro_batch_index"])}
    steps = pd.read_parquet(work / "replay_steps.parquet")
    ok = steps[(steps["kind"] == "micro_batch") & (steps["status"] == "OK")]
    totals = {}
    for name, times in census.items():
        units = ok[ok["strategy"] == name].copy()
        units["census_s"] = [times[position[int(m)]] for m in units["micro_batch_index"]]
        by = units.groupby("stratum").agg(
            size=("stratum_size", "first"), replay=("time_s", "mean"), census=("census_s", "mean")
        )
        totals[name] = [float((by["size"] * by[c]).sum()) for c in ("replay", "census")]
        totals[name].append(float(times.sum()))
        print(name, len(units), "units: replay", round(units["time_s"].sum(), 3),
              "census of the same", round(units["census_s"].sum(), 3), "| expansion from the "
              "replay's times", round(totals[name][0], 3), "from the census's",
              round(totals[name][1], 3), "census total", round(totals[name][2], 3),
              flush=True)  # fmt: skip
    pairs = zip(totals["random"], totals["padding_free_eager"], strict=True)
    savings = [1 - b / r for r, b in pairs]
    print("padding_free_eager saving: expansion from the replay's times", round(savings[0], 3),
          "from the census's times of the same units", round(savings[1], 3),
          "census", round(savings[2], 3), flush=True)  # fmt: skip


def kept_plan_batches(factory, work: Path, n: int) -> tuple:
    """The base and the change's own trainer, and the first `n` micro-batches of the random plan
    that a replay-units run kept in `work`, collated by each one's own collator."""
    import os

    import pandas as pd

    os.environ["PROBES_BENCH_RUN"] = str(work / "run.json")
    base = build_trainer(factory, {"output_dir": str(work / "r")})
    own = build_trainer(factory, {"output_dir": str(work / "b"), **CHANGE})
    plan = pd.read_parquet(work / "plans.parquet")
    ids = list(plan[plan["strategy"] == "random"]["example_ids"])[:n]
    rows = [[base.train_dataset[int(i)] for i in x] for x in ids]
    return base, own, rows


def passes(trainer, batches) -> float:
    trainer.model.train()
    start = time.perf_counter()
    for batch in batches:
        trainer.training_step(trainer.model, batch, loss_items(batch))
    return time.perf_counter() - start


def switched_vs_own(factory, work: Path) -> None:
    """On a replay-units run's kept plan (`work`): 80 flattened micro-batches through the change's
    own trainer and through the replay's step (the base trainer switched to eager), each with
    its own collator's batches and with the other's. Three times."""
    import os

    from probes.step.changes import StepConfig, apply_config
    from probes.step.trainer import TrainerStep, probe_settings

    os.environ["PROBES_BENCH_RUN"] = str(work / "run.json")
    _, own, rows = kept_plan_batches(factory, work, 80)
    settings = probe_settings(str(work / "a"), torch.device("cpu"), torch.float32, 256, 0)
    base = TrainerStep(build_trainer(factory, settings), factory, 256)
    apply_config(base.model, StepConfig(False, "eager"), base.trainer.args)
    own_batches = [own.data_collator(r) for r in rows]
    replay_batches = [base.flat_collator(r) for r in rows]
    same = all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
        for a, b in zip(own_batches, replay_batches, strict=True)
        for k in a
    )
    print("the two collators' batches equal:", same, flush=True)
    passes(own, own_batches[:3]), passes(base.trainer, replay_batches[:3])
    for _ in range(3):
        print("own trainer, own batches", round(passes(own, own_batches), 3),
              "own trainer, replay's batches", round(passes(own, replay_batches), 3),
              "switched base, replay's batches", round(passes(base.trainer, replay_batches), 3),
              "switched base, own batches", round(passes(base.trainer, own_batches), 3),
              flush=True)  # fmt: skip


def sequence_context(factory, work: Path) -> None:
    """On a replay-units run's kept plan (`work`): 100 micro-batches, padded on the baseline's
    trainer and flattened on the change's own, in sequence with the collector on, in sequence
    with it off (as the replay times), and interleaved one of each with it off. Three times."""
    import gc

    base, own, rows = kept_plan_batches(factory, work, 100)
    padded = [base.data_collator(r) for r in rows]
    flat = [own.data_collator(r) for r in rows]

    def interleaved() -> tuple[float, float]:
        r = b = 0.0
        for one, other in zip(padded, flat, strict=True):
            r += passes(base, [one])
            b += passes(own, [other])
        return r, b

    passes(base, padded[:3]), passes(own, flat[:3])
    for _ in range(3):
        on = passes(base, padded), passes(own, flat)
        gc.disable()
        off = passes(base, padded), passes(own, flat)
        mixed = interleaved()
        gc.enable()
        print(" | ".join(
            f"{label}: R {r:.3f} B {b:.3f} B/R {b / r:.3f}"
            for label, (r, b) in (("in sequence, gc on", on), ("in sequence, gc off", off),
                                  ("interleaved, gc off", mixed))
        ), flush=True)  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    check, lengths, recommendation = sys.argv[1:4]
    if check in ("switched-vs-own", "sequence-context"):  # LENGTHS: a kept replay-units dir
        factory, work = load_factory(rvp.FACTORY), Path(lengths)
    else:
        factory, work = bench_factory(lengths, recommendation)
    checks = {
        "census": census,
        "cold-shapes": cold_shapes,
        "back-to-back": back_to_back,
        "after-switch": after_switch,
        "interleaved-vs-blocks": interleaved_vs_blocks,
        "replay-units": replay_units,
        "switched-vs-own": switched_vs_own,
        "sequence-context": sequence_context,
    }
    checks[check](factory, work)
