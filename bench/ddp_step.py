"""Benchmark: real DDP optimizer steps under torchrun against the prediction from one process.

Two phases, one run:

1. **One process** (``torch.set_num_threads(1)``): every micro-batch of random batching and of the
   recommended strategy (length grouping at the bucket size the sweep recommends at W ranks) is
   timed forward + backward through a tiny random-init Llama (real architecture, SDPA), plus one
   optimizer step. Micro-batches come from ``probes.batching.orders`` and are sharded over the
   ranks by ``probes.batching.ranks`` exactly as accelerate's ``BatchSamplerShard`` does.
2. **torchrun** ``--nproc_per_node W`` (gloo, one thread per rank): the same model wrapped in
   ``DistributedDataParallel`` runs each rank's shard; ``no_sync`` on all but a step's last
   micro-batch (what ``accelerator.accumulate`` does). A DDP communication hook splits each
   step's gradient synchronisation into the rank's **wait** (a barrier: until the slowest rank's
   gradients are ready) and the **collective** (the all-reduce itself); the rest of the step is
   the rank's **compute**.

Prediction per step = max over ranks of the one-process times of that rank's micro-batches
+ the optimizer step + the measured collective time (mean per step). Printed per strategy: the
real epoch time (wall, rank 0, after a barrier), the prediction and their ratio, and the mean
compute / wait / collective per rank and step. Exits 1 when a ratio is outside ``--tolerance``
(default 0.10).

    python bench/ddp_step.py                 # W = 2, gloo
    python bench/ddp_step.py --examples 64   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from probes.batching import orders  # noqa: E402
from probes.dp import predict as dp_predict  # noqa: E402
from probes.dp import shard  # noqa: E402


def build_model(vocab: int, hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).float()


def make_batch(lengths: list[int], vocab: int, seed: int):
    """A right-padded micro-batch of random tokens (labels = inputs, padding masked out)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ------------------------------------------------------------------------------------- plans


def rank_plans(
    lengths: np.ndarray, order: np.ndarray, micro: int, grad_accum: int, world: int
) -> list[list[list[list[int]]]]:
    """plan[rank][step] = that step's micro-batches (lists of example lengths) on that rank,
    sharded as the data_parallel stage does (probes.dp.shard, accelerate's even_batches)."""
    plan = shard.rank_plans(order.size, micro, grad_accum, world)
    return shard.map_plan(plan, lengths[order])


def recommended_bucket(lengths: np.ndarray, micro: int, grad_accum: int, world: int) -> int:
    """The sweep's recommendation judged at `world` ranks (probes.bucket)."""
    from probes.bucket import data_parallel as dp
    from probes.bucket import sweep as bucket
    from probes.lengths import LengthSet

    data = LengthSet(lengths, np.zeros(lengths.size, np.int32), ("none",))
    args = {"micro_batch_size": micro, "grad_accum": grad_accum, "max_seq_len": int(lengths.max())}
    sweep = bucket.sweep_bucket_sizes(data, **args, seeds=[0], batch_rebalance=False)
    table = dp.data_parallel_sweep(data, **args, seeds=[0], world_sizes=[1, world])
    rec = bucket.recommend(sweep, 0.9, 0.8, data_parallel=table, world_size=world)
    return int(rec["recommended"]["bucket_size_batches"])


def build_plans(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    # heavy-tailed lengths in [16, max_len]: most short, a few long (the straggler's source)
    lengths = np.clip(rng.lognormal(np.log(48), 0.9, args.examples), 16, args.max_len)
    lengths = lengths.astype(np.int64)
    perm = orders.seeded_permutation(lengths.size, args.seed)
    m = recommended_bucket(lengths, args.micro, args.grad_accum, args.world)
    strategies = {
        "random": orders.length_grouped_order(lengths, perm, args.micro, 1),
        f"length_grouped(m={m})": orders.length_grouped_order(lengths, perm, args.micro, m),
    }
    return {
        name: rank_plans(lengths, order, args.micro, args.grad_accum, args.world)
        for name, order in strategies.items()
    }


# ---------------------------------------------------------------------------- torchrun


def plan_shapes(plans: dict) -> list[tuple[int, ...]]:
    return sorted(
        {tuple(b) for plan in plans.values() for rank in plan for step in rank for b in step}
    )


def one_process_times(model, optimizer, shapes, vocab: int) -> dict:
    """Forward + backward seconds of every micro-batch shape on the plain (unwrapped) model, no
    communication, and one optimizer step: a one-process measurement."""
    import time as clock

    times = {}
    for shape in shapes:
        batch = make_batch(list(shape), vocab, seed=len(shape))
        start = clock.perf_counter()
        model(**batch).loss.backward()
        times[shape] = clock.perf_counter() - start
    start = clock.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return {"micro_batch": times, "optimizer": clock.perf_counter() - start}


def predict(plan: list, single: dict, collective_per_step: float) -> float:
    """Σ over steps of (max over ranks of Σ one-process micro-batch times) + optimizer + comm
    (probes.dp.predict.predict_epoch)."""
    per_rank = [[sum(single["micro_batch"][tuple(b)] for b in step) for step in r] for r in plan]
    return dp_predict.predict_epoch(per_rank, single["optimizer"], collective_per_step)


def worker(args: argparse.Namespace) -> None:
    """One rank. Each round: one-process timings of every shape (plain model, no communication),
    then every strategy's shard under DDP. Rounds interleave the two, so both see the same load
    on the machine. Writes per-round timings as JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = json.loads(Path(args.plans).read_text())
    shapes = plan_shapes(plans)
    plain = build_model(args.vocab, args.hidden, args.layers)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    model = build_model(args.vocab, args.hidden, args.layers)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
    from probes.dp.worker import timed_allreduce_hook

    record: dict[str, float] = {"wait": 0.0, "collective": 0.0}
    hook = timed_allreduce_hook(record, world)
    ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    rounds = []
    for round_index in range(args.rounds + 1):  # round 0 warms up
        dist.barrier()
        single = one_process_times(plain, plain_optimizer, shapes, args.vocab)
        ddp_round = {}
        for name, plan in plans.items():
            steps = []
            dist.barrier()
            epoch_start = time.perf_counter()
            for step in plan[rank]:
                record.update(wait=0.0, collective=0.0)
                start = time.perf_counter()
                for k, lengths in enumerate(step):
                    batch = make_batch(lengths, args.vocab, seed=len(lengths))
                    if k < len(step) - 1:
                        with ddp.no_sync():
                            ddp(**batch).loss.backward()
                    else:
                        ddp(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                total = time.perf_counter() - start
                steps.append(
                    {
                        "step_s": total,
                        "wait_s": record["wait"],
                        "collective_s": record["collective"],
                        "compute_s": total - record["wait"] - record["collective"],
                    }
                )
            dist.barrier()
            ddp_round[name] = {"epoch_s": time.perf_counter() - epoch_start, "steps": steps}
        if round_index:
            rounds.append(
                {
                    "single": {
                        "micro_batch": [[list(k), v] for k, v in single["micro_batch"].items()],
                        "optimizer": single["optimizer"],
                    },
                    "ddp": ddp_round,
                }
            )
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rounds))
    dist.destroy_process_group()


def run_torchrun(args: argparse.Namespace, plans_path: Path, out: Path) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world}",
        str(Path(__file__).resolve()),
        "--worker",
        f"--plans={plans_path}",
        f"--out={out}",
        f"--backend={args.backend}",
        f"--rounds={args.rounds}",
        f"--vocab={args.vocab}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"torchrun failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plans", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--examples", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    from probes.distributed import LaunchError, check_launch

    try:
        check_launch(args.world, args.backend)
    except LaunchError as error:
        print(f"ddp_step: {error}", file=sys.stderr)
        return 2
    plans = build_plans(args)
    with tempfile.TemporaryDirectory() as tmp:
        plans_path = Path(tmp, "plans.json")
        plans_path.write_text(json.dumps(plans))
        started = time.perf_counter()
        results = run_torchrun(args, plans_path, Path(tmp))
        wall = time.perf_counter() - started
    print(
        f"W={args.world} {args.backend}, 1 thread per rank; {args.examples} examples, micro "
        f"{args.micro} x grad_accum {args.grad_accum}; {args.rounds} rounds; torchrun {wall:.0f} s"
    )
    print(
        f"{'strategy':<22} {'steps':>5} {'real s':>8} {'predicted s':>11} {'ratio':>6} "
        f"{'compute/step':>12} {'wait/step':>10} {'allreduce/step':>14} {'comm share':>10}"
    )
    failed = False
    for name, plan in plans.items():
        reals, predictions, ratios = [], [], []
        for index in range(args.rounds):
            per_rank = [rank_rounds[index] for rank_rounds in results]
            steps = [s for r in per_rank for s in r["ddp"][name]["steps"]]
            collective = statistics.mean(s["collective_s"] for s in steps)
            # one-process times: per shape, the median over ranks of this round
            single = {
                "micro_batch": {
                    tuple(shape): statistics.median(
                        dict((tuple(k), v) for k, v in r["single"]["micro_batch"])[tuple(shape)]
                        for r in per_rank
                    )
                    for shape, _ in per_rank[0]["single"]["micro_batch"]
                },
                "optimizer": statistics.median(r["single"]["optimizer"] for r in per_rank),
            }
            real = per_rank[0]["ddp"][name]["epoch_s"]
            predicted = predict(plan, single, collective)
            reals.append(real)
            predictions.append(predicted)
            ratios.append(real / predicted)
        steps = [s for rank in results for r in rank for s in r["ddp"][name]["steps"]]
        collective = statistics.mean(s["collective_s"] for s in steps)
        wait = statistics.mean(s["wait_s"] for s in steps)
        compute = statistics.mean(s["compute_s"] for s in steps)
        real, predicted = statistics.median(reals), statistics.median(predictions)
        ratio = statistics.median(ratios)
        failed |= abs(ratio - 1) > args.tolerance
        print(
            f"{name:<22} {len(plan[0]):>5} {real:>8.3f} {predicted:>11.3f} {ratio:>6.3f} "
            f"{compute * 1e3:>10.1f}ms {wait * 1e3:>8.1f}ms {collective * 1e3:>12.1f}ms "
            f"{collective * len(plan[0]) / real:>10.1%}"
        )
        print(f"{'':<22} per round real/predicted: {', '.join(f'{v:.3f}' for v in ratios)}")
    print(f"median ratio within ±{args.tolerance:.0%}: {'yes' if not failed else 'NO'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
