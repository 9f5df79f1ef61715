"""The collapse guard: a sweep must vary something (design rule 5).

An earlier version silently collapsed every bucket size to a global sort. The guard checks the
sweep's two ends against references that share no code with the ordering, and that the
efficiency varies across bucket sizes wherever random and sorted batching differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from probes.batching.orders import all_bucket_size, seeded_permutation
from probes.errors import ProbeError
from probes.lengths import LengthSet


class SweepCollapsedError(ProbeError, AssertionError):
    """The sweep did not vary with bucket size although the lengths say it must."""


def reference_random_padded(lengths: np.ndarray, perm: np.ndarray, batch_size: int) -> int:
    """Padded tokens of HF's ordering with bucket size 1, computed without any sorting code.

    Micro-batches are the shuffle's consecutive chunks, except that HF swaps the longest example
    into batch 0 in exchange for batch 0's longest.
    """
    n = perm.size
    starts = np.arange(0, n, batch_size)
    chunk_len = lengths[perm]
    batch_len = np.maximum.reduceat(chunk_len, starts)
    best = int(np.argmax(batch_len))  # the first batch holding the global maximum
    if best != 0:
        first = chunk_len[:batch_size].copy()
        other = chunk_len[best * batch_size : (best + 1) * batch_size].copy()
        i_first, i_other = int(np.argmax(first)), int(np.argmax(other))
        first[i_first], other[i_other] = other[i_other], first[i_first]
        batch_len[0], batch_len[best] = first.max(), other.max()
    rows = np.diff(np.r_[starts, n])
    return int((rows * batch_len).sum())


def reference_sorted_padded(lengths: np.ndarray, batch_size: int) -> int:
    """Padded tokens of a global descending sort, computed without the ordering code."""
    ordered = np.sort(lengths)[::-1]
    starts = np.arange(0, ordered.size, batch_size)
    rows = np.diff(np.r_[starts, ordered.size])
    return int((rows * ordered[starts]).sum())


def assert_sweep_varies(
    sweep: pd.DataFrame, data: LengthSet, micro_batch_size: int
) -> dict[str, Any]:
    """Fail loudly if the sweep collapsed (every bucket size the same, or the ends are wrong).

    Checks, against references that share no code with the ordering:
    1. bucket size 1 reproduces random batching's padded tokens exactly, seed by seed;
    2. the largest bucket size reproduces the global sort's padded tokens exactly;
    3. where random and the global sort differ at all, the mean token efficiency differs across
       bucket sizes (the original bug made every size a global sort).
    Returns what was checked; raises SweepCollapsedError otherwise.
    """
    grouped = sweep.loc[sweep["bucket_size_batches"].notna()]
    lengths = data.lengths
    sorted_ref = reference_sorted_padded(lengths, micro_batch_size)
    m_max = int(grouped["bucket_size_batches"].max())
    m_all = all_bucket_size(lengths.size, micro_batch_size)
    problems: list[str] = []
    random_refs: dict[int, int] = {}
    for seed, rows in grouped.groupby("seed"):
        perm = seeded_permutation(lengths.size, int(seed))
        random_refs[int(seed)] = reference_random_padded(lengths, perm, micro_batch_size)
        at_1 = rows.loc[rows["bucket_size_batches"] == 1, "padded_tokens"]
        if at_1.empty or int(at_1.iloc[0]) != random_refs[int(seed)]:
            problems.append(
                f"seed {seed}: bucket size 1 gave {at_1.tolist()} padded tokens, random batching "
                f"gives {random_refs[int(seed)]}"
            )
        if m_max == m_all:
            at_all = int(rows.loc[rows["bucket_size_batches"] == m_all, "padded_tokens"].iloc[0])
            if at_all != sorted_ref:
                problems.append(
                    f"seed {seed}: bucket size {m_all} (all) gave {at_all} padded tokens, a "
                    f"global sort gives {sorted_ref}"
                )
    can_gain = any(ref != sorted_ref for ref in random_refs.values())
    efficiency = grouped.groupby("bucket_size_batches")["token_efficiency"].mean()
    spread = float(efficiency.max() - efficiency.min())
    if can_gain and (efficiency.size < 2 or spread <= 0.0):
        problems.append(
            f"token efficiency is {efficiency.iloc[0]:.6f} at every bucket size "
            f"{efficiency.index.tolist()} although random and sorted batching differ"
        )
    result = {
        "applicable": bool(can_gain),
        "reason": (
            "random and sorted batching differ; the sweep must vary"
            if can_gain
            else "random batching is already as good as a global sort: nothing to gain"
        ),
        "efficiency_spread": spread,
        "random_padded_reference": random_refs,
        "sorted_padded_reference": sorted_ref,
        "problems": problems,
    }
    if problems:
        raise SweepCollapsedError(
            "bucket sweep collapsed or wrong: " + "; ".join(problems) + ". The ordering must "
            "sort within each megabatch only (see the README's collapse rule)."
        )
    return result
