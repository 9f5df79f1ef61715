"""Which shape each of the gate's checks runs at, and the trace that reads dispatch without values.

Two kinds of fact come out of a traced scenario. Whether each layer's mask keeps documents apart,
never attends padding and keeps its window exact (the band) is a property of transformers' mask
code and of where the documents and padding sit relative to the window, not of T itself: it is
checked on dense masks at the *semantic shape*, the smallest length whose padded rows and packed
documents sit on every side of the sliding window that the training shape's do (longer than it,
within it), and the same remainder modulo flex attention's block size (flex's last block is as
ragged). What SDPA is handed (a mask or is_causal, the mask's shape and dtype, hence the
backend) is read at the training shape, where it depends on T, by a *dispatch trace*: the
model's own forward with transformers building each mask for one query row and broadcasting it
over the others, so the SDPA call has the real shapes and dtype without the B x T x T values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from probes.mask.scenarios import padded_lengths, split_lengths

FLEX_BLOCK = (
    128  # flex attention's default BlockMask block size (torch's _DEFAULT_SPARSE_BLOCK_SIZE)
)
MIN_BLOCKS = 2  # the semantic shape spans at least this many flex blocks (skipped, partial, full)
# scenarios whose band is checked at the semantic shape; the window scenarios have their own
# lengths and `train` is the band per layer at the training shape itself
REDUCIBLE = ("right_padded", "left_padded", "packed", "token_type_ids")


@dataclass(frozen=True)
class ShapePlan:
    batch: int
    training_seq_len: int
    semantic_seq_len: int
    reason: str

    @property
    def reduced(self) -> bool:
        return self.semantic_seq_len < self.training_seq_len

    def as_dict(self) -> dict[str, Any]:
        return {
            "training": f"{self.batch}x{self.training_seq_len}",
            "semantic": f"{self.batch}x{self.semantic_seq_len}",
            "reason": self.reason,
        }


def _sides(lengths: list[int], window: int) -> set[str]:
    return {"above" if n > window else "within" for n in lengths}


def window_relations(seq_len: int, batch: int, mask_cfg: dict[str, Any], window: int) -> dict:
    """Per padded/packed layout, on which side of the window its rows and documents sit."""
    padded = padded_lengths(seq_len, batch, float(mask_cfg["pad_fraction"]))
    packed = split_lengths(seq_len, list(mask_cfg["packed_doc_fractions"]))
    return {
        "padded_rows": _sides(padded, window),
        "padding": {"some"} if min(padded) < seq_len else set(),
        "packed_documents": _sides(packed, window),
        "sequence": _sides([seq_len], window),
    }


def plan_shapes(
    mask_cfg: dict[str, Any], training_cfg: dict[str, Any], window: int | None
) -> ShapePlan:
    """The semantic shape: the shortest T' <= T (T' = T mod FLEX_BLOCK, at least MIN_BLOCKS
    blocks) whose padded rows and packed documents sit on every side of `window` that the
    training shape's do (longer than the window, within it; a shorter T' may add a side)."""
    batch = int(training_cfg["micro_batch_size"])
    seq_len = int(training_cfg["max_seq_len"])
    start = seq_len % FLEX_BLOCK + FLEX_BLOCK * MIN_BLOCKS
    if start >= seq_len:
        return ShapePlan(batch, seq_len, seq_len, "the training shape is already this small")
    if window is None:
        return ShapePlan(
            batch,
            seq_len,
            start,
            f"no sliding layer: the shortest length congruent to {seq_len} mod {FLEX_BLOCK} "
            f"(flex's block) spanning {MIN_BLOCKS} blocks",
        )
    wanted = window_relations(seq_len, batch, mask_cfg, window)
    for candidate in range(start, seq_len, FLEX_BLOCK):
        try:
            found = window_relations(candidate, batch, mask_cfg, window)
        except ValueError:  # too short to split into the packed documents
            continue
        if all(found[key] >= sides for key, sides in wanted.items()):
            return ShapePlan(
                batch,
                seq_len,
                candidate,
                f"the shortest length congruent to {seq_len} mod {FLEX_BLOCK} (flex's block) "
                f"with padded rows and packed documents on every side of the window {window} "
                f"they sit on at {batch}x{seq_len}",
            )
    return ShapePlan(batch, seq_len, seq_len, "no shorter length relates to the window alike")


@contextmanager
def masks_without_values() -> Iterator[None]:
    """transformers builds each dense mask for the last query row only and broadcasts it over the
    rows (its shape, dtype and last stride are what SDPA is handed; the values are not)."""
    import transformers.masking_utils as masking_utils

    non_vmap = masking_utils._non_vmap_expansion_sdpa
    vmap = masking_utils._vmap_expansion_sdpa

    def one_row(batch, head, q, kv):
        return non_vmap(batch, head, q[-1:], kv)

    def one_row_vmap(mask_function):
        expanded = vmap(mask_function)

        def call(batch, head, q, kv):
            return expanded(batch, head, q[-1:], kv).expand(-1, -1, q.shape[0], -1)

        return call

    masking_utils._non_vmap_expansion_sdpa = one_row
    masking_utils._vmap_expansion_sdpa = one_row_vmap
    try:
        yield
    finally:
        masking_utils._non_vmap_expansion_sdpa = non_vmap
        masking_utils._vmap_expansion_sdpa = vmap
