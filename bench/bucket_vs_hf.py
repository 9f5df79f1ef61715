"""Benchmark: the whole bucket sweep vs HF's get_length_grouped_indices, in one run.

On N synthetic heavy-tailed lengths (default 1,000,000), times

- TRL: packing, ``trl.data_utils.pack_dataset(strategy="bfd")`` through
  ``probes.batching.packing.pack`` (the library's own code, which the stage calls once);
- ours: probes.bucket.sweep.sweep_bucket_sizes over every bucket size × seed (orderings, all
  metrics, the packing rows' metrics) plus the collapse guard and the recommendation;
- HF: transformers.trainer_pt_utils.get_length_grouped_indices producing the same number of
  orderings (same lengths as a list, as LengthGroupedSampler holds them, same bucket sizes, same
  seeds through torch.Generator().manual_seed(seed)); orderings only, no metrics;
- old: the sweep as it was at ``--against`` (default: the commit before packing became TRL's,
  with its own FFD and BFD packers), run from ``git archive`` of that commit in a subprocess.

Ours is timed before and after HF and the slower run counts. Prints every number, the new sweep
(TRL + ours) against the old one, and the ratio ours / HF; exits 1 if ours takes more than
--max-ratio (default 1/4) of HF's time. The library's packing is left out of that ratio as
transformers' BatchRebalanceSampler is: neither has a counterpart on the HF side. Spot-checks that
both produce identical orderings (outside the timings).

    python bench/bucket_vs_hf.py            # the issue's figure
    python bench/bucket_vs_hf.py --n 100000  # quicker
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from probes.batching import orders, packing
from probes.bucket import control as bucket_controls
from probes.bucket import guard
from probes.bucket import sweep as bucket
from probes.lengths import LengthSet

REPO = Path(__file__).resolve().parents[1]
# The last commit whose sweep packed with the project's own FFD and BFD (issue 31 replaced them).
BEFORE_TRL_PACKING = "94a39da"

OLD_SWEEP = """
import json, sys, time
import numpy as np
from probes.bucket import control, sweep as bucket
from probes.lengths import LengthSet
n, micro, accum, max_len, seeds = json.loads(sys.argv[1])
full, sources = control.synthetic_lengths(n, seed=0, max_seq_len=max_len)
data = LengthSet(np.minimum(full, max_len), sources, tuple(f"s{i}" for i in range(8)))
started = time.perf_counter()
sweep = bucket.sweep_bucket_sizes(data, micro, accum, max_len, seeds, batch_rebalance=False)
bucket.assert_sweep_varies(sweep, data, micro)
bucket.recommend(sweep, gain_share=0.9, min_diversity_share=0.8)
elapsed = time.perf_counter() - started
rows = sweep.loc[sweep["strategy"].str.startswith("packing_")].groupby("strategy")["n_bins"].first()
print(json.dumps({"seconds": elapsed, "rows": {k: int(v) for k, v in rows.items()}}))
"""


def time_trl(data: LengthSet, args: argparse.Namespace) -> tuple[float, dict]:
    import trl.data_utils  # noqa: F401  (imports are not the packing: seconds, once per process)

    started = time.perf_counter()
    packed = packing.pack_all(data.lengths, args.max_seq_len)
    return time.perf_counter() - started, packed


def time_old(args: argparse.Namespace) -> dict | None:
    """The old sweep, from ``git archive`` of ``args.against``, in a fresh interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "old.tar"
        made = subprocess.run(
            ["git", "archive", "-o", str(archive), args.against, "scripts"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            print(f"old sweep not timed: {made.stderr.strip()}", file=sys.stderr)
            return None
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        setup = [args.n, args.micro_batch_size, args.grad_accum, args.max_seq_len, args.seeds]
        run = subprocess.run(
            [sys.executable, "-c", OLD_SWEEP, json.dumps(setup)],
            env={**os.environ, "PYTHONPATH": str(Path(tmp) / "scripts")},
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        print(f"old sweep failed: {run.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def time_ours(data: LengthSet, args: argparse.Namespace, packed: dict) -> tuple[float, int]:
    started = time.perf_counter()
    sweep = bucket.sweep_bucket_sizes(
        data,
        micro_batch_size=args.micro_batch_size,
        grad_accum=args.grad_accum,
        max_seq_len=args.max_seq_len,
        seeds=args.seeds,
        packing=packing.PACKING_STRATEGIES,
        packed=packed,
        progress=True,
        # transformers' own BatchRebalanceSampler (pure Python, ~35 µs per example per seed) has
        # no counterpart on the HF side of this comparison of orderings: leave it out.
        batch_rebalance=False,
    )
    guard.assert_sweep_varies(sweep, data, args.micro_batch_size)
    bucket.recommend(sweep, gain_share=0.9, min_diversity_share=0.8)
    elapsed = time.perf_counter() - started
    return elapsed, int(sweep["bucket_size_batches"].notna().sum())


def time_hf(lengths: list[int], sizes: list[int], args: argparse.Namespace) -> tuple[float, int]:
    import torch
    from tqdm import tqdm
    from transformers.trainer_pt_utils import get_length_grouped_indices

    count = 0
    started = time.perf_counter()
    with tqdm(total=len(sizes) * len(args.seeds), desc="HF orderings") as bar:
        for seed in args.seeds:
            for m in sizes:
                get_length_grouped_indices(
                    lengths,
                    args.micro_batch_size,
                    mega_batch_mult=m,
                    generator=torch.Generator().manual_seed(seed),
                )
                count += 1
                bar.update()
    return time.perf_counter() - started, count


def spot_check(data: LengthSet, lengths: list[int], sizes: list[int], micro: int) -> bool:
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    seed = 0
    perm = orders.seeded_permutation(data.lengths.size, seed)
    for m in (sizes[0], sizes[len(sizes) // 2], sizes[-1]):
        ours = orders.length_grouped_order(data.lengths, perm, micro, m)
        theirs = get_length_grouped_indices(
            lengths, micro, mega_batch_mult=m, generator=torch.Generator().manual_seed(seed)
        )
        if ours.tolist() != theirs:
            print(f"MISMATCH with HF at bucket size {m}", file=sys.stderr)
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="number of lengths")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--max-ratio", type=float, default=0.25)
    parser.add_argument(
        "--against",
        default=BEFORE_TRL_PACKING,
        help="git revision whose sweep to time as the old one ('' skips it)",
    )
    args = parser.parse_args()

    full, sources = bucket_controls.synthetic_lengths(args.n, seed=0, max_seq_len=args.max_seq_len)
    lengths = np.minimum(full, args.max_seq_len)
    data = LengthSet(lengths, sources, tuple(f"s{i}" for i in range(int(sources.max()) + 1)))
    sizes = orders.sweep_bucket_sizes_for(args.n, args.micro_batch_size, args.grad_accum)
    as_list = lengths.tolist()
    print(
        f"{args.n:,} lengths (median {int(np.median(lengths))}, p99 "
        f"{int(np.percentile(lengths, 99))}, max {int(lengths.max())}); {len(sizes)} bucket sizes "
        f"{sizes} x {len(args.seeds)} seeds; micro-batch {args.micro_batch_size}, "
        f"grad_accum {args.grad_accum}",
        flush=True,
    )
    identical = spot_check(data, as_list, sizes, args.micro_batch_size)
    trl, packed = time_trl(data, args)
    ours_1, n_ours = time_ours(data, args, packed)
    hf, n_hf = time_hf(as_list, sizes, args)
    ours_2, _ = time_ours(data, args, packed)
    ours = max(ours_1, ours_2)
    ratio = ours / hf
    old = time_old(args) if args.against else None
    print(
        f"orderings: ours {n_ours} (+ packing), HF {n_hf}; identical to HF on spot check: "
        f"{identical}"
    )
    rows = {name: rows.n_rows for name, rows in packed.items()}
    print(f"TRL pack_dataset (packing rows {rows}):                     {trl:.2f} s")
    print(
        f"ours (whole sweep, metrics, packing rows, guard, recommendation): {ours:.2f} s "
        f"(runs: {ours_1:.2f} s, {ours_2:.2f} s)"
    )
    print(f"HF get_length_grouped_indices (orderings only):              {hf:.2f} s")
    print(f"ratio ours / HF: {ratio:.3f} (must be <= {args.max_ratio})")
    if old is not None:
        print(
            f"new sweep (TRL + ours) {trl + ours:.2f} s against the old sweep at {args.against} "
            f"(own FFD and BFD) {old['seconds']:.2f} s; old packing rows {old['rows']}"
        )
    return 0 if ratio <= args.max_ratio and identical and n_ours == n_hf else 1


if __name__ == "__main__":
    sys.exit(main())
