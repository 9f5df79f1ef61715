"""The bucket stage's positive control (known answers) and synthetic lengths for tests and bench."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from probes.batching import packing as packers
from probes.batching.orders import OrderFn, length_grouped_order, seeded_permutation
from probes.bucket.guard import SweepCollapsedError, assert_sweep_varies
from probes.bucket.sweep import sweep_bucket_sizes
from probes.contracts import SKIPPED_STATUSES
from probes.lengths import LengthSet

CONTROL_SEEDS = (0, 1, 2, 3, 4)


def global_sort_collapse(
    lengths: np.ndarray, perm: np.ndarray, batch_size: int, mega_batch_mult: int
) -> np.ndarray:
    """The historical bug, kept to test the collapse guard: ignores the bucket size entirely."""
    return length_grouped_order(lengths, perm, batch_size, math.ceil(perm.size / batch_size))


def _odd_share_hypergeometric(population: int, successes: int, draws: int) -> float:
    """P(an odd number of successes) when drawing without replacement (exact, big ints)."""
    total = math.comb(population, draws)
    odd = sum(
        math.comb(successes, x) * math.comb(population - successes, draws - x)
        for x in range(1, min(successes, draws) + 1, 2)
    )
    return odd / total


def two_length_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """Known answer: N/2 examples of 64 tokens (source a), N/2 of 1024 (source b), micro-batch 2.

    A megabatch of M = 2m examples sorted by length holds at most one mixed micro-batch, mixed
    exactly when it drew an odd number of long examples, so the expected number of mixed
    micro-batches is (N / M) · P(odd) (hypergeometric, exact); the global sort has none at all
    (token efficiency 1.0, one source per micro-batch). Tolerance: 4 binomial standard errors of
    the mean over seeds, plus 2 for HF's longest-first swap.
    """
    n, short, long_ = 4096, 64, 1024
    micro = 2
    lengths = np.repeat(np.array([short, long_], dtype=np.int64), n // 2)
    sources = np.repeat(np.array([0, 1], dtype=np.int32), n // 2)
    data = LengthSet(lengths, sources, ("a", "b"))
    sizes = [1, 2, 8, 32, 128, 512, n // micro]
    sweep = sweep_bucket_sizes(
        data,
        micro,
        1,
        long_,
        CONTROL_SEEDS,
        bucket_sizes=sizes,
        packing=(),
        order_fn=order_fn,
        batch_rebalance=False,
    )
    real = int(lengths.sum())
    checks = []
    for m in sizes:
        rows = sweep.loc[sweep["bucket_size_batches"] == m]
        mixed = float(((rows["padded_tokens"] - real) / (long_ - short)).mean())
        megabatches = n // (m * micro)
        p_odd = _odd_share_hypergeometric(n, n // 2, m * micro)
        expected = megabatches * p_odd
        tolerance = (
            4 * math.sqrt(megabatches * p_odd * (1 - p_odd) / len(CONTROL_SEEDS)) + 2
            if m < n // micro
            else 0.0
        )
        checks.append(
            {
                "bucket_size_batches": m,
                "expected_mixed_micro_batches": expected,
                "observed_mixed_micro_batches": mixed,
                "tolerance": tolerance,
                "passed": bool(abs(mixed - expected) <= tolerance),
            }
        )
    at_all = sweep.loc[sweep["bucket_size_batches"] == n // micro]
    global_sort_exact = bool(
        (at_all["token_efficiency"] == 1.0).all()
        and (at_all["micro_distinct_sources"] == 1.0).all()
    )
    return {
        "checks": checks,
        "global_sort_token_efficiency": float(at_all["token_efficiency"].mean()),
        "global_sort_distinct_sources_per_micro_batch": float(
            at_all["micro_distinct_sources"].mean()
        ),
        "passed": bool(all(c["passed"] for c in checks) and global_sort_exact),
        "sweep": sweep,
        "data": data,
    }


def hf_equivalence_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """Our ordering equals transformers' get_length_grouped_indices index for index."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    rng = np.random.default_rng(20260824)
    heavy = np.clip(rng.lognormal(5.0, 1.2, 1000), 1, 4096).astype(np.int64)  # ties included
    two = np.repeat(np.array([64, 1024], dtype=np.int64), 2048)
    cases = [(two, 2, m, 0) for m in (1, 8, 2048)]
    cases += [(heavy, 3, m, 1) for m in (1, 5, 50, 334)]
    results = []
    for lengths, batch, mult, seed in cases:
        ours = order_fn(lengths, seeded_permutation(lengths.size, seed), batch, mult)
        theirs = get_length_grouped_indices(
            lengths.tolist(),
            batch,
            mega_batch_mult=mult,
            generator=torch.Generator().manual_seed(seed),
        )
        results.append(
            {
                "n": int(lengths.size),
                "batch_size": batch,
                "mega_batch_mult": mult,
                "seed": seed,
                "identical": bool(ours.tolist() == list(theirs)),
            }
        )
    return {"cases": results, "passed": all(r["identical"] for r in results)}


def packing_control() -> dict[str, Any]:
    """Known answer: 100 × 768 + 10 × 512 + 100 × 256 tokens in 1024-token rows = 105 full rows.

    Packed by the library (``probes.batching.packing``: TRL's ``pack_dataset``) through the
    lengths-only dataset, so it also checks that every example comes back in exactly one row.
    """
    capacity = 1024
    lengths = np.concatenate([np.full(100, 768), np.full(10, 512), np.full(100, 256)]).astype(
        np.int64
    )
    rng = np.random.default_rng(0)
    lengths = lengths[rng.permutation(lengths.size)]
    observed = {}
    for name in packers.PACKING_STRATEGIES:
        rows = packers.pack(lengths, capacity, name)
        fill = np.bincount(rows.bin_of(), weights=lengths, minlength=rows.n_rows)
        observed[name] = {
            "n_bins": rows.n_rows,
            "token_efficiency": float(lengths.sum() / (rows.n_rows * capacity)),
            "overfull_bins": int((fill > capacity).sum()),
            "every_example_once": bool(
                np.array_equal(np.sort(rows.documents), np.arange(lengths.size))
            ),
        }
    passed = all(
        o["n_bins"] == 105
        and o["token_efficiency"] == 1.0
        and o["overfull_bins"] == 0
        and o["every_example_once"]
        for o in observed.values()
    )
    return {
        "expected": {"n_bins": 105, "token_efficiency": 1.0, "every_example_once": True},
        "observed": observed,
        "passed": passed,
    }


def run_control(order_fn: OrderFn = length_grouped_order) -> dict[str, Any]:
    """The stage's positive control: known answers the instrument must recover first."""
    two = two_length_control(order_fn)
    hf = hf_equivalence_control(order_fn)
    packing = packing_control()
    guard_passes_real = True
    try:
        assert_sweep_varies(two["sweep"], two["data"], 2)
    except SweepCollapsedError:
        guard_passes_real = False
    collapsed = sweep_bucket_sizes(
        two["data"],
        2,
        1,
        1024,
        CONTROL_SEEDS[:2],
        bucket_sizes=[1, 8, 2048],
        packing=(),
        order_fn=global_sort_collapse,
        batch_rebalance=False,
    )
    try:
        assert_sweep_varies(collapsed, two["data"], 2)
        guard_fires_on_collapse = False
    except SweepCollapsedError:
        guard_fires_on_collapse = True
    passed = (
        two["passed"]
        and hf["passed"]
        and packing["passed"]
        and guard_passes_real
        and guard_fires_on_collapse
    )
    return {
        "name": "bucket_known_answers",
        "description": (
            "Synthetic two-length set (2048 × 64 and 2048 × 1024 tokens, two sources, "
            "micro-batch 2): mixed micro-batches per bucket size must match the exact "
            "hypergeometric expectation and the global sort must be padding-free and "
            "single-source; the ordering must equal transformers' get_length_grouped_indices "
            "index for index; TRL's pack_dataset (bfd) must pack a set with a known perfect "
            "packing into 105 full rows, each example in exactly one; the collapse guard must "
            "pass the real sweep and fire on a collapsing one."
        ),
        "expected": {
            "mixed_micro_batches": {
                c["bucket_size_batches"]: round(c["expected_mixed_micro_batches"], 3)
                for c in two["checks"]
            },
            "global_sort_token_efficiency": 1.0,
            "global_sort_distinct_sources_per_micro_batch": 1.0,
            "hf_identical_orderings": len(hf["cases"]),
            "packing": packing["expected"],
            "guard_passes_real_sweep": True,
            "guard_fires_on_collapsed_sweep": True,
        },
        "observed": {
            "mixed_micro_batches": {
                c["bucket_size_batches"]: round(c["observed_mixed_micro_batches"], 3)
                for c in two["checks"]
            },
            "mixed_micro_batches_tolerance": {
                c["bucket_size_batches"]: round(c["tolerance"], 3) for c in two["checks"]
            },
            "global_sort_token_efficiency": two["global_sort_token_efficiency"],
            "global_sort_distinct_sources_per_micro_batch": two[
                "global_sort_distinct_sources_per_micro_batch"
            ],
            "hf_identical_orderings": sum(r["identical"] for r in hf["cases"]),
            "hf_cases": hf["cases"],
            "packing": packing["observed"],
            "guard_passes_real_sweep": guard_passes_real,
            "guard_fires_on_collapsed_sweep": guard_fires_on_collapse,
        },
        "passed": bool(passed),
    }


# --------------------------------------------------------------------------------------------
# Synthetic input (tests, benchmark, trying the stage without the padding stage)
# --------------------------------------------------------------------------------------------


def synthetic_lengths(
    n: int, seed: int = 0, max_seq_len: int = 4096, n_sources: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Heavy-tailed full lengths (lognormal, median ~150-400 tokens) and source codes.

    Sources differ in typical length, as real mixtures do, so length grouping costs diversity.
    Returns (full lengths before truncation, source codes).
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_sources + 1)  # Zipf-like source sizes
    sources = rng.choice(n_sources, size=n, p=weights / weights.sum()).astype(np.int32)
    mu = 5.0 + 1.0 * sources / max(n_sources - 1, 1)
    full = np.ceil(rng.lognormal(mu, 1.0)).astype(np.int64)
    return np.maximum(full, 1), sources


def synthetic_lengths_frame(
    n: int,
    seed: int = 0,
    max_seq_len: int = 4096,
    n_sources: int = 8,
    empty_share: float = 0.01,
    error_share: float = 0.005,
) -> pd.DataFrame:
    """A table with the padding stage's lengths schema (example_id ... n_truncated_tokens)."""
    full, sources = synthetic_lengths(n, seed, max_seq_len, n_sources)
    rng = np.random.default_rng(seed + 1)
    status = np.where(full > max_seq_len, "TRUNCATED", "OK").astype(object)
    draw = rng.random(n)
    status[draw < empty_share + error_share] = "ERROR"
    status[draw < empty_share] = "EMPTY"
    bad = np.isin(status, SKIPPED_STATUSES)
    full = np.where(bad, 0, full)
    kept = np.minimum(full, max_seq_len)
    return pd.DataFrame(
        {
            "example_id": [f"{seed:04x}{i:012x}" for i in range(n)],
            "file": "synthetic.jsonl",
            "row": np.arange(n, dtype=np.int64),
            "source": [f"source_{s}" for s in sources],
            "status": status.astype(str),
            "n_tokens": kept,
            "n_tokens_full": full,
            "n_loss_tokens": kept // 2,
            "n_turns": np.where(bad, 0, 2),
            "n_truncated_tokens": full - kept,
        }
    )
