"""Example orderings for length-grouped batching: HF's shuffle and megabatch sort, bucket sizes.

``length_grouped_order`` is Hugging Face's ``get_length_grouped_indices`` semantics, vectorised:
shuffle, cut into megabatches of ``m × micro_batch_size`` examples, sort each megabatch by length
(descending, stable), keep megabatch order, move the longest megabatch head to the very front. A
megabatch holding the whole dataset is the global sort.

Seeds: the shuffle is ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``, the very
call HF makes, so a seed here reproduces HF's ordering index for index (a control checks it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

# HF's cap on mega_batch_mult when the Trainer leaves it unset.
HF_MAX_MEGA_BATCH_MULT = 50
# Megabatches at least this large are sorted row-wise (radix sort on uint16 keys); smaller ones in
# one global stable sort over (megabatch, -length). Both give the identical order.
_ROW_SORT_MIN = 64

OrderFn = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


def seeded_permutation(n: int, seed: int) -> np.ndarray:
    """HF's shuffle: ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``.

    Using torch rather than numpy makes seed s reproduce
    ``get_length_grouped_indices(..., generator=torch.Generator().manual_seed(s))`` exactly.
    """
    import torch  # imported here: the rest of the module needs numpy only

    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


def length_grouped_order(
    lengths: np.ndarray, perm: np.ndarray, batch_size: int, mega_batch_mult: int
) -> np.ndarray:
    """``transformers.trainer_pt_utils.get_length_grouped_indices`` given its shuffle ``perm``.

    Same result index for index, vectorised: megabatches of ``mega_batch_mult × batch_size``
    consecutive shuffled indices, each sorted by length descending (stable, as Python's sorted),
    then the longest megabatch head swapped with megabatch 0's head (OOM early, as HF does).
    """
    n = perm.size
    megabatch = batch_size * mega_batch_mult
    permuted = lengths[perm]
    top = int(permuted.max())
    desc_key = top - permuted  # ascending key == descending length; stable keeps shuffle order
    if megabatch >= _ROW_SORT_MIN and top < 2**16:
        full = n // megabatch * megabatch
        rows = desc_key[:full].astype(np.uint16).reshape(-1, megabatch)
        within = np.argsort(rows, axis=1, kind="stable")
        within += np.arange(0, full, megabatch, dtype=np.int64)[:, None]
        tail = np.argsort(desc_key[full:], kind="stable") + full
        positions = np.concatenate([within.ravel(), tail])
    else:
        megabatch_id = np.arange(n, dtype=np.int64) // megabatch
        positions = np.argsort(megabatch_id * (top + 1) + desc_key, kind="stable")
    order = perm[positions]
    heads = lengths[order[::megabatch]]
    longest = int(np.argmax(heads)) * megabatch  # first maximum, as torch.argmax
    order[0], order[longest] = order[longest], order[0]
    return order


def hf_trainer_mega_batch_mult(n: int, micro_batch_size: int, grad_accum: int) -> int:
    """Bucket size, in micro-batches, that HF's Trainer uses with group_by_length.

    The Trainer builds LengthGroupedSampler with batch = micro × grad_accum and leaves
    mega_batch_mult unset: min(n // (4 × batch), 50), at least 1.
    """
    batch = micro_batch_size * grad_accum
    mult = max(min(n // (batch * 4), HF_MAX_MEGA_BATCH_MULT), 1)
    return mult * grad_accum


def all_bucket_size(n: int, micro_batch_size: int) -> int:
    """The bucket size (in micro-batches) that holds the whole dataset: a global sort."""
    return max(math.ceil(n / micro_batch_size), 1)


def sweep_bucket_sizes_for(
    n: int, micro_batch_size: int, grad_accum: int, requested: Iterable[int] | None = None
) -> list[int]:
    """Bucket sizes to sweep: 1, 2, 4, ..., 50, HF Trainer's default, all (deduplicated).

    A requested list is clipped to [1, all]; 1 (random) and all (global sort) are always added:
    the gains are measured against the first and the best is usually the second.
    """
    m_all = all_bucket_size(n, micro_batch_size)
    if requested is None:
        sizes = {2**k for k in range(max(m_all.bit_length(), 1)) if 2**k < m_all}
        sizes |= {
            HF_MAX_MEGA_BATCH_MULT,
            hf_trainer_mega_batch_mult(n, micro_batch_size, grad_accum),
        }
    else:
        sizes = {int(m) for m in requested}
    sizes = {min(max(m, 1), m_all) for m in sizes} | {1, m_all}
    return sorted(sizes)
