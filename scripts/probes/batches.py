"""Batch shapes for the timed steps, built from the padding stage's lengths (never from text).

Step time depends on shapes, masks and which tokens carry loss, not on token values: the stage
times random token ids laid out exactly like the user's batches (lengths, padding, loss tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes.ce import IGNORE_INDEX
from probes.lengths import LengthsError


def loss_fraction(train: pd.DataFrame) -> float:
    """Share of training tokens that carry loss (the reference harness runs the head on these)."""
    tokens = float(train["n_tokens"].sum())
    return float(train["n_loss_tokens"].sum()) / tokens if tokens > 0 else 1.0


@dataclass(frozen=True)
class PaddingPick:
    example_ids: list[str]
    n_tokens: list[int]
    n_loss_tokens: list[int]
    padding_waste: float  # share of the padded batch's tokens that are padding
    method: str

    @property
    def longest(self) -> int:
        return max(self.n_tokens)

    @property
    def n_real_tokens(self) -> int:
        return int(sum(self.n_tokens))


def pick_padding_batch(
    train: pd.DataFrame,
    batch_size: int,
    max_len: int,
    seed: int,
    draws: int = 256,
    waste_quantile: float = 0.5,
) -> PaddingPick:
    """A random micro-batch as an unbucketed loader hands it out: of `draws` seeded random
    batches whose longest member fits `max_len`, the one at `waste_quantile` of padding waste
    (0.5: a typical batch; 0.9: a bad one)."""
    eligible = train[train["n_tokens"] <= max_len].reset_index(drop=True)
    if len(eligible) < batch_size:
        raise LengthsError(
            f"only {len(eligible)} training example(s) have <= {max_len} tokens; need "
            f"{batch_size} for the padding-penalty batch (raise the largest profile length)."
        )
    rng = np.random.default_rng(seed)
    lengths = eligible["n_tokens"].to_numpy()
    picks = np.stack(
        [rng.choice(len(eligible), size=batch_size, replace=False) for _ in range(draws)]
    )
    batch_lengths = lengths[picks]
    waste = 1.0 - batch_lengths.sum(axis=1) / (batch_size * batch_lengths.max(axis=1))
    order = np.argsort(waste, kind="stable")
    at = order[int(round(waste_quantile * (len(order) - 1)))]
    chosen = picks[at]
    rows = eligible.iloc[chosen]
    share = len(eligible) / len(train)
    return PaddingPick(
        example_ids=[str(v) for v in rows["example_id"]],
        n_tokens=[int(v) for v in rows["n_tokens"]],
        n_loss_tokens=[int(v) for v in rows["n_loss_tokens"]],
        padding_waste=float(waste[at]),
        method=(
            f"padding-waste quantile {waste_quantile:g} of {draws} seeded random batches "
            f"(seed {seed}) drawn from the "
            f"{len(eligible)} examples ({share:.1%}) with <= {max_len} tokens"
        ),
    )


def _labels_for(length: int, n_loss: int, ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
    # loss on the last n_loss tokens (an assistant reply closes the conversation); the first token
    # of a sequence is never predicted
    n_loss = min(max(n_loss, 0), length - 1)
    if n_loss:
        labels[length - n_loss :] = ids[length - n_loss :]
    return labels


def padded_batch(
    lengths: Sequence[int],
    loss_tokens: Sequence[int],
    vocab_size: int,
    generator: torch.Generator,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Right-padded [B, pad_to] batch: input_ids, attention_mask (0 on padding), labels."""
    width = pad_to or max(lengths)
    batch = len(lengths)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
    low = min(8, vocab_size - 1)  # skip the first ids, where tokenizers keep special tokens
    for row, (length, n_loss) in enumerate(zip(lengths, loss_tokens, strict=True)):
        ids = torch.randint(low, vocab_size, (length,), generator=generator)
        input_ids[row, :length] = ids
        attention_mask[row, :length] = 1
        labels[row, :length] = _labels_for(length, n_loss, ids)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch(
    lengths: Sequence[int],
    loss_tokens: Sequence[int],
    vocab_size: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """All documents in one row, position_ids restarting at 0 per document and no attention_mask:
    the format in which transformers builds a mask that keeps the documents apart."""
    low = min(8, vocab_size - 1)
    ids, labels, positions = [], [], []
    for length, n_loss in zip(lengths, loss_tokens, strict=True):
        doc = torch.randint(low, vocab_size, (length,), generator=generator)
        ids.append(doc)
        labels.append(_labels_for(length, n_loss, doc))
        positions.append(torch.arange(length))
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
    }


def uniform_batch(
    batch_size: int, length: int, loss_fraction_: float, vocab_size: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A scaling point: batch_size rows of exactly `length` tokens, the data's loss share each."""
    n_loss = int(round(loss_fraction_ * length))
    return padded_batch([length] * batch_size, [n_loss] * batch_size, vocab_size, generator)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) for key, value in batch.items()}
