"""Benchmark: the bucket sweep's padded-token prediction against what the real Trainer feeds.

On the padding stage's real lengths (``results/padding/lengths.parquet``; synthetic heavy-tailed
lengths if it is missing, said in the output), for three configurations

- ``drop_in``: ``probes.sampler.length_grouped_trainer(Trainer)`` at the recommended bucket size,
- ``group_by_length``: ``TrainingArguments(train_sampling_strategy="group_by_length")``,
- ``batch_rebalance``: ``TrainingArguments(train_sampling_strategy="batch_rebalance")``,

it records the shape of every micro-batch the Trainer feeds (a collator that pads to the longest
row) and compares the padded tokens with the sweep's prediction:

1. full data through the Trainer's own train DataLoader (``get_train_dataloader`` after
   ``set_epoch(0)``, as ``Trainer._run_epoch`` does; no model step);
2. a sample (``--sample`` examples) through a real ``Trainer.train()`` epoch of a tiny random-init
   causal LM on CPU.

"predicted (this shuffle)" is the sweep's functions on the shuffle the configuration draws;
"predicted (sweep mean)" is the sweep's mean over seeds 0-4, the number the report shows. Also
prints batch_rebalance's efficiency beside the recommended bucket size (from the sweep on the full
data). Reports the load (os.getloadavg) it ran under; no timing is asserted.

    python bench/apply_prediction.py   # with probes installed (pip install -e .)
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the Trainer fixtures live with the tests

from trainer_fixtures import RecordingCollator, TokenDataset, tiny_llama  # noqa: E402

from probes.batching import metrics as batch_metrics  # noqa: E402
from probes.batching import orders, rebalance  # noqa: E402
from probes.bucket import control as bucket_controls  # noqa: E402
from probes.lengths import LengthSet, read_lengths  # noqa: E402
from probes.sampler import length_grouped_trainer, trainer_group_by_length_permutation  # noqa: E402

SWEEP_SEEDS = (0, 1, 2, 3, 4)
REBALANCE_TRAINER_SEED = 42  # BatchRebalanceSampler's default; the Trainer passes none


def make_trainer(config: str, lengths: np.ndarray, args: argparse.Namespace, out: str) -> Any:
    import transformers

    strategy = {"drop_in": "random"}.get(config, config)
    training_args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        num_train_epochs=1,
        learning_rate=1e-3,
        seed=args.seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        train_sampling_strategy=strategy,
    )
    common = {
        "model": tiny_llama(int(lengths.max())),
        "args": training_args,
        "train_dataset": TokenDataset(lengths),
        "data_collator": RecordingCollator(),
    }
    if config == "drop_in":
        return length_grouped_trainer(transformers.Trainer)(
            **common, bucket_size_batches=args.bucket_size
        )
    return transformers.Trainer(**common)


def prediction(config: str, lengths: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Padded tokens the sweep's functions predict: for this run's shuffle and over seeds."""
    micro, accum, n = args.micro_batch_size, args.grad_accum, lengths.size

    def padded(order: np.ndarray, rows: np.ndarray | None = None) -> int:
        z = np.zeros(order.size, dtype=np.int32)
        return batch_metrics.padded_metrics(lengths[order], z, micro, accum, 1, rows)[
            "padded_tokens"
        ]

    if config == "batch_rebalance":
        this = padded(*rebalance.rebalance_order(lengths, micro, accum, REBALANCE_TRAINER_SEED))
        over_seeds = [
            padded(*rebalance.rebalance_order(lengths, micro, accum, s)) for s in SWEEP_SEEDS
        ]
        bucket_size = None
    else:
        bucket_size = (
            args.bucket_size
            if config == "drop_in"
            else orders.hf_trainer_mega_batch_mult(n, micro, accum)
        )
        perm = (
            orders.seeded_permutation(n, args.seed)
            if config == "drop_in"
            else trainer_group_by_length_permutation(n, args.seed)
        )
        this = padded(orders.length_grouped_order(lengths, perm, micro, bucket_size))
        over_seeds = [
            padded(
                orders.length_grouped_order(
                    lengths, orders.seeded_permutation(n, s), micro, bucket_size
                )
            )
            for s in SWEEP_SEEDS
        ]
    return {
        "bucket_size_batches": bucket_size,
        "predicted_this_shuffle": int(this),
        "predicted_sweep_mean": float(np.mean(over_seeds)),
        "predicted_sweep_std": float(np.std(over_seeds)),
    }


def compare(fed: int, predicted: dict[str, Any], real: int) -> dict[str, Any]:
    return {
        **predicted,
        "fed": fed,
        "rel_diff_this_shuffle": fed / predicted["predicted_this_shuffle"] - 1,
        "rel_diff_sweep_mean": fed / predicted["predicted_sweep_mean"] - 1,
        "token_efficiency_fed": real / fed,
    }


def run_dataloader(config: str, lengths: np.ndarray, args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(config, lengths, args, out)
        loader = trainer.get_train_dataloader()
        loader.set_epoch(0)  # as Trainer._run_epoch
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(0)
        for _ in loader:
            pass
        return trainer.data_collator.padded_tokens


def run_train(config: str, lengths: np.ndarray, args: argparse.Namespace) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(config, lengths, args, out)
        started = time.perf_counter()
        trainer.train()
        return trainer.data_collator.padded_tokens, time.perf_counter() - started


def load_lengths(args: argparse.Namespace) -> tuple[LengthSet, str]:
    if args.lengths.is_file():
        return read_lengths(args.lengths, args.max_seq_len), str(args.lengths)
    full, sources = bucket_controls.synthetic_lengths(7168, seed=0, max_seq_len=args.max_seq_len)
    data = LengthSet(np.minimum(full, args.max_seq_len), sources, tuple(f"s{i}" for i in range(8)))
    return data, f"synthetic heavy-tailed lengths (no {args.lengths})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=Path, default=Path("results/padding/lengths.parquet"))
    parser.add_argument(
        "--recommendation", type=Path, default=Path("results/bucket/recommendation.json")
    )
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--bucket-size", type=int, help="default: the recommendation's")
    parser.add_argument("--sample", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    data, origin = load_lengths(args)
    rec = json.loads(args.recommendation.read_text()) if args.recommendation.is_file() else None
    if args.bucket_size is None:
        args.bucket_size = int(rec["recommended"]["bucket_size_batches"]) if rec else 32
    lengths = data.lengths
    real = int(lengths.sum())
    load_before = os.getloadavg()
    print(f"lengths: {origin}: {lengths.size} examples, {real} tokens, max {lengths.max()}")
    print(
        f"micro {args.micro_batch_size} × grad_accum {args.grad_accum}, drop-in bucket "
        f"{args.bucket_size} micro-batches, seed {args.seed}; load {load_before}"
    )
    results: dict[str, Any] = {"lengths": origin, "load_before": load_before, "full": {}}
    configs = ["drop_in", "group_by_length"]
    if rebalance.unavailable_reason() is None:
        configs.append("batch_rebalance")
    for config in configs:
        fed = run_dataloader(config, lengths, args)
        results["full"][config] = compare(fed, prediction(config, lengths, args), real)
    rng = np.random.default_rng(args.seed)
    sample = lengths[rng.choice(lengths.size, size=min(args.sample, lengths.size), replace=False)]
    sample_args = argparse.Namespace(**vars(args))
    results["sample"] = {"n": int(sample.size), "tokens": int(sample.sum())}
    for config in configs:
        fed, seconds = run_train(config, sample, sample_args)
        results["sample"][config] = {
            **compare(fed, prediction(config, sample, sample_args), int(sample.sum())),
            "train_seconds": seconds,
        }
    results["load_after"] = os.getloadavg()
    if rec:
        results["beside"] = {
            name: {
                k: (rec.get(name) or {}).get(k)
                for k in ("bucket_size_batches", "token_efficiency", "attention_efficiency")
            }
            for name in ("random", "recommended", "hf_trainer_default", "batch_rebalance")
        }
    for part in ("full", "sample"):
        print(
            f"\n{part}: config | bucket | fed | predicted (this shuffle) | diff | "
            "sweep mean ± sd | diff"
        )
        for config in configs:
            r = results[part][config]
            print(
                f"  {config:16s} {str(r['bucket_size_batches']):>6s} {r['fed']:>10d} "
                f"{r['predicted_this_shuffle']:>10d} {100 * r['rel_diff_this_shuffle']:+.3f}% "
                f"{r['predicted_sweep_mean']:>12.0f} ± {r['predicted_sweep_std']:.0f} "
                f"{100 * r['rel_diff_sweep_mean']:+.2f}%"
                + (f"  train {r['train_seconds']:.1f} s" if "train_seconds" in r else "")
            )
    if rec:
        print("\nefficiency (sweep, full data, mean over seeds): token / attention")
        for name, point in results["beside"].items():
            print(f"  {name:20s} {point}")
    print(f"load after: {results['load_after']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    worst = max(
        abs(results[part][c]["rel_diff_this_shuffle"])
        for part in ("full", "sample")
        for c in configs
    )
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
