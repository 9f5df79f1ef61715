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

from probes.lengths import LengthsError
from probes.step.ce import IGNORE_INDEX


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


def too_few_for_a_batch(train: pd.DataFrame, n_fit: int, max_len: int, batch_size: int) -> str:
    """Why no padding-penalty batch can be drawn, with the one change that would help."""
    if len(train) < batch_size:  # a longer profile length cannot help here
        return (
            f"only {len(train)} usable training example(s), fewer than "
            f"training.micro_batch_size={batch_size}: no padding-penalty batch (use more data)"
        )
    return (
        f"only {n_fit} training example(s) have <= {max_len} tokens; need {batch_size} for the "
        "padding-penalty batch (raise the largest profile length)."
    )


def _drawn_batches(
    train: pd.DataFrame, batch_size: int, max_len: int, seed: int, draws: int
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """The examples that fit, `draws` seeded random batches of them (row indices) and each
    batch's padding waste."""
    eligible = train[train["n_tokens"] <= max_len].reset_index(drop=True)
    if len(eligible) < batch_size:
        raise LengthsError(too_few_for_a_batch(train, len(eligible), max_len, batch_size))
    rng = np.random.default_rng(seed)
    lengths = eligible["n_tokens"].to_numpy()
    picks = np.stack(
        [rng.choice(len(eligible), size=batch_size, replace=False) for _ in range(draws)]
    )
    batch_lengths = lengths[picks]
    waste = 1.0 - batch_lengths.sum(axis=1) / (batch_size * batch_lengths.max(axis=1))
    return eligible, picks, waste


def _pick(eligible: pd.DataFrame, rows: np.ndarray, waste: float, method: str) -> PaddingPick:
    chosen = eligible.iloc[rows]
    return PaddingPick(
        example_ids=[str(v) for v in chosen["example_id"]],
        n_tokens=[int(v) for v in chosen["n_tokens"]],
        n_loss_tokens=[int(v) for v in chosen["n_loss_tokens"]],
        padding_waste=waste,
        method=method,
    )


PADDING_LENGTH_QUANTILES = (0.75, 0.95)  # the band of training lengths the batches come from
PADDING_BATCHES = 3  # distinct batches timed, for the spread of the penalty


def padding_length_band(
    train: pd.DataFrame,
    max_len: int,
    batch_size: int,
    quantiles: tuple[float, float] = PADDING_LENGTH_QUANTILES,
) -> tuple[pd.DataFrame, str]:
    """Examples from the upper part of the training length distribution (quantiles[0] to
    quantiles[1] of n_tokens) that fit `max_len`: long enough for compute, not padding, to show.
    When fewer than `batch_size` of those fit, the same upper share of the examples that do fit."""
    low_q, high_q = quantiles
    lengths = train["n_tokens"]
    low, high = float(lengths.quantile(low_q)), float(lengths.quantile(high_q))
    band = train[(lengths >= low) & (lengths <= min(high, max_len))]
    how = (
        f"lengths p{low_q * 100:g}-p{high_q * 100:g} of the {len(train)} training examples "
        f"({low:.0f}-{high:.0f} tokens)"
    )
    if len(band) < batch_size:
        fits = train[lengths <= max_len]
        if len(fits) < batch_size:
            raise LengthsError(too_few_for_a_batch(train, len(fits), max_len, batch_size))
        fit_lengths = fits["n_tokens"]
        low = float(fit_lengths.quantile(low_q))
        high = float(fit_lengths.quantile(high_q))
        band = fits[(fit_lengths >= low) & (fit_lengths <= high)]
        if len(band) < batch_size:
            band = fits.nlargest(batch_size, "n_tokens")
            low, high = float(band["n_tokens"].min()), float(band["n_tokens"].max())
        how = (
            f"lengths p{low_q * 100:g}-p{high_q * 100:g} of the {len(fits)} examples that fit "
            f"<= {max_len} tokens ({low:.0f}-{high:.0f} tokens; the band of all "
            f"{len(train)} does not fit the largest length that ran)"
        )
    return band.reset_index(drop=True), how


def pick_padding_batches(
    train: pd.DataFrame,
    batch_size: int,
    max_len: int,
    seed: int,
    draws: int = 256,
    waste_quantile: float = 0.5,
    n_batches: int = PADDING_BATCHES,
    quantiles: tuple[float, float] = PADDING_LENGTH_QUANTILES,
) -> list[PaddingPick]:
    """`n_batches` micro-batches from the upper length band (padding_length_band), each picked
    at the padding-waste quantile of seeded random draws (an unbucketed loader's batches),
    distinct from each other, so the penalty comes with a spread."""
    band, how = padding_length_band(train, max_len, batch_size, quantiles)
    eligible, drawn, waste = _drawn_batches(band, batch_size, max_len, seed, draws)
    order = np.argsort(waste, kind="stable")
    start = int(round(waste_quantile * (len(order) - 1)))
    # outward from the waste quantile: the nearest draws that are distinct batches
    by_distance = sorted(range(len(order)), key=lambda i: (abs(i - start), i))
    picks: list[PaddingPick] = []
    seen: set[frozenset[int]] = set()
    for position in by_distance:
        index = int(order[position])
        key = frozenset(int(v) for v in drawn[index])
        if key in seen:
            continue
        seen.add(key)
        picks.append(_pick(eligible, drawn[index], float(waste[index]), ""))
        if len(picks) == n_batches:
            break
    method = (
        f"{how}; {len(picks)} distinct batches nearest padding-waste quantile "
        f"{waste_quantile:g} of {draws} seeded random batches (seed {seed}) of the "
        f"{len(eligible)} examples in the band"
    )
    return [
        PaddingPick(p.example_ids, p.n_tokens, p.n_loss_tokens, p.padding_waste, method)
        for p in picks
    ]


def predicted_step_times(
    a: float, b: float, c: float, fit_batch: int, lengths: Sequence[int]
) -> dict[str, float]:
    """Step time of each padding variant from the fit t(T) = aT^2 + bT + c of `fit_batch` rows
    of T tokens, read per row: a row of n tokens costs (a n^2 + b n) / fit_batch, a step c.

    padded: every row padded to the longest, one step; one_by_one: each row its own micro-batch,
    so len(lengths) steps' fixed cost; packed: one row of sum(n) tokens whose dense attention
    costs (sum n)^2 (a block-diagonal mask computed densely), one step."""
    longest, total = max(lengths), sum(lengths)

    def row(n: float) -> float:
        return (a * n * n + b * n) / fit_batch

    return {
        "padded": len(lengths) * row(longest) + c,
        "one_by_one": sum(row(n) + c for n in lengths),
        "packed": row(total) + c,
    }


def loss_position_count(labels: torch.Tensor) -> int:
    """Positions whose hidden state predicts a loss token (position t predicts t+1)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


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


def plan_batch(
    row: Any, vocab_size: int, generator: torch.Generator, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """The micro-batch of a plan row with the project's builders (right padding, or packed
    documents with restarting position ids); random token ids, real lengths and loss tokens."""
    from probes.batching.plans import PACKED

    lengths = [int(v) for v in row.example_lengths]
    loss = [int(v) for v in row.example_loss_tokens]
    if row.layout == PACKED:
        return packed_batch(lengths, loss, vocab_size, generator)
    return padded_batch(
        lengths, loss, vocab_size, generator, pad_to=int(row.padded_length), pad_id=pad_id
    )
