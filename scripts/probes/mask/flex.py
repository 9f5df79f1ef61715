"""What ``flex_attention`` attends, as a dense boolean mask the band code can measure.

transformers hands flex attention a ``BlockMask``: per (query block, key block) whether the block
is skipped, full (every key attended, ``mask_mod`` never evaluated) or partial (``mask_mod``
decides per position). The kernel attends exactly: full blocks, plus partial blocks where
``mask_mod`` allows. ``dense_allowed`` rebuilds that, so a block wrongly marked full or skipped
shows as a band violation just as a wrong ``mask_mod`` does.

While tracing, transformers' ``create_block_mask(..., _compile=True)`` runs uncompiled: compiling
evaluates the same ``mask_mod`` over the same blocks and on a CPU it costs a minute per shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

FLEX = "flex_attention"


def _blocks_to_positions(
    blocks: torch.Tensor, block_size: tuple[int, int], q_len: int, kv_len: int
) -> torch.Tensor:
    """(B, H, q blocks, kv blocks) flags as (B, H, q_len, kv_len) per position (one copy of
    the boolean blocks broadcast over their positions)."""
    batch, heads, q_blocks, kv_blocks = blocks.shape
    per_position = blocks.bool()[:, :, :, None, :, None].expand(
        batch, heads, q_blocks, block_size[0], kv_blocks, block_size[1]
    )
    positions = per_position.reshape(batch, heads, q_blocks * block_size[0], -1)
    return positions[..., :q_len, :kv_len]


def dense_allowed(block_mask: Any) -> torch.Tensor:
    """(B, H, Q, KV) boolean: the positions flex attention attends under `block_mask`."""
    from torch.nn.attention import flex_attention

    batch, heads, q_len, kv_len = (int(v) for v in block_mask.shape)
    size = tuple(int(v) for v in block_mask.BLOCK_SIZE)
    partial = flex_attention._ordered_to_dense(
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_indices.shape[-1]
    )
    # module attribute: within uncompiled_block_masks, what building the BlockMask evaluated
    by_mod = flex_attention.create_mask(
        block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu"
    )
    allowed = _blocks_to_positions(partial, size, q_len, kv_len) & by_mod
    if block_mask.full_kv_num_blocks is not None:
        full = flex_attention._ordered_to_dense(
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
            block_mask.full_kv_indices.shape[-1],
        )
        allowed = allowed | _blocks_to_positions(full, size, q_len, kv_len)
    return allowed


@contextmanager
def uncompiled_block_masks() -> Iterator[None]:
    """transformers' masking code builds its BlockMasks without torch.compile meanwhile, and
    torch's ``create_mask`` keeps what it evaluated per mask_mod and shape: building a BlockMask
    evaluates ``mask_mod`` at every position, and ``dense_allowed`` asks for the same again."""
    import torch.nn.attention.flex_attention as flex_attention
    import transformers.masking_utils as masking_utils

    original = getattr(masking_utils, "create_block_mask", None)
    if original is None:  # a transformers without flex support: nothing to patch
        yield
        return

    def create_block_mask(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "_compile": False})

    create_mask = flex_attention.create_mask
    evaluated: dict[tuple, tuple[Any, torch.Tensor]] = {}  # the mask_mod kept: ids not reused

    def remembered(mask_mod: Any, B: Any, H: Any, Q_LEN: Any, KV_LEN: Any, device: Any = "cpu"):
        key = (id(mask_mod), B, H, Q_LEN, KV_LEN, str(device))
        if key not in evaluated:
            evaluated[key] = (mask_mod, create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device))
        return evaluated[key][1]

    masking_utils.create_block_mask = create_block_mask
    flex_attention.create_mask = remembered
    try:
        yield
    finally:
        masking_utils.create_block_mask = original
        flex_attention.create_mask = create_mask
