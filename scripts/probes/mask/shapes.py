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

from collections.abc import Callable, Iterator
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


class SdpaMasks:
    """The SDPA masks transformers built during one trace, each kept as the arguments of its
    mask interface call: SDPA was handed the mask's last query row broadcast over the rows (its
    real shape, dtype and last stride), and :meth:`rows` builds any block of its real rows by
    the same call for those rows only (``q_length``, ``q_offset``), so the band is measured
    without the B x T x T mask ever existing at once."""

    def __init__(self, interface: Callable[..., Any]) -> None:
        self.interface = interface
        self.built: dict[int, tuple[Any, dict[str, Any]]] = {}  # storage -> (mask, arguments)

    def keep(self, mask: Any, arguments: dict[str, Any]) -> None:
        # the tensor is kept so its storage (the key) is not reused by a later mask
        self.built[mask.untyped_storage().data_ptr()] = (mask, arguments)

    def arguments_of(self, mask: Any) -> dict[str, Any] | None:
        kept = self.built.get(mask.untyped_storage().data_ptr())
        return None if kept is None else kept[1]

    def rows(self, arguments: dict[str, Any], start: int, stop: int) -> Any:
        """Query rows [start, stop) of the mask built with `arguments`, as transformers builds
        them (B, 1, stop - start, kv_length)."""
        return self.interface(
            **{
                **arguments,
                "q_length": stop - start,
                "q_offset": int(arguments.get("q_offset") or 0) + start,
                "allow_is_causal_skip": False,  # known: this mask was not skipped
                "allow_is_bidirectional_skip": False,
            }
        )


@contextmanager
def sdpa_masks_by_rows() -> Iterator[SdpaMasks]:
    """Within the block, transformers' SDPA mask interface decides mask or is_causal as always
    but builds each mask for its last query row only, broadcast over the rows; the masks and
    their arguments are in the yielded SdpaMasks."""
    import inspect

    import transformers.masking_utils as masking_utils

    mapping = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]
    signature = inspect.signature(original)
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )
    masks = SdpaMasks(original)

    def interface(*args: Any, **kwargs: Any) -> Any:
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop(var_keyword, None) or {})
        with _last_query_row(masking_utils):
            mask = original(**arguments)
        if mask is not None:
            masks.keep(mask, arguments)
        return mask

    mapping["sdpa"] = interface
    try:
        yield masks
    finally:
        mapping["sdpa"] = original


@contextmanager
def _last_query_row(masking_utils: Any) -> Iterator[None]:
    """sdpa_mask's two expansions (index broadcasting, vmap) evaluate the mask function for the
    last query row and broadcast it over the others."""
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
