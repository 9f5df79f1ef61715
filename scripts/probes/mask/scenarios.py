"""The mask gate's scenarios: the batches each trace runs (the training shape, sequence lengths
around the sliding window, right/left padded, packed, token_type_ids) and the document ids that
say which positions belong together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probes.errors import ProbeError
from probes.mask import band as mask_band


class CollatorError(ProbeError, ValueError):
    """A packed scenario's collator did not lay the documents out as one row."""


# A collator: per-document features in, one micro-batch out (what a Trainer's dataloader calls).
Collate = Callable[[list[dict[str, Any]]], Mapping[str, Any]]
# What the gate passes on from a collator's batch: the ids, what shapes the mask, and the
# varlen kwargs flash attention reads (labels and the like never reach attention).
MASK_INPUT_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def flattening_collator() -> Collate:
    """transformers' DataCollatorWithFlattening (what TRL's ``padding_free`` lays out too): one
    row, position ids restarting per document, no attention mask."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True)


# --- scenarios -----------------------------------------------------------------------------------


@dataclass
class Scenario:
    """One input batch: shapes plus where each document and padding sits."""

    name: str
    description: str
    doc_ids: np.ndarray  # (B, T): document index per position, -1 on padding
    padding: str = "none"  # none | right | left
    packed: bool = False
    token_type_ids: bool = False
    # packed: the collator that lays the documents out (None: the project's own layout)
    collator: Collate | None = None

    @property
    def batch(self) -> int:
        return int(self.doc_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.doc_ids.shape[1])

    @functools.cached_property
    def n_docs(self) -> int:
        return int(max(len(set(row[row >= 0].tolist())) for row in self.doc_ids))

    def key_is_pad(self) -> torch.Tensor:
        return torch.from_numpy(self.doc_ids < 0)

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """What a collator hands the model: ids, a 2-D padding mask or restarting position ids."""
        if self.packed and self.collator is not None:
            return self.collated()
        ids = torch.ones(self.batch, self.seq_len, dtype=torch.long)
        inputs: dict[str, torch.Tensor | None] = {"input_ids": ids}
        if self.packed:
            # DataCollatorWithFlattening: one row, position_ids restart per document, no mask
            starts = mask_band.document_starts(self.doc_ids)
            positions = np.arange(self.seq_len)[None, :] - starts
            inputs["position_ids"] = torch.from_numpy(positions.astype(np.int64))
        else:
            inputs["attention_mask"] = torch.from_numpy((self.doc_ids >= 0).astype(np.int64))
        if self.token_type_ids:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        return inputs

    def document_lengths(self) -> list[int]:
        """Tokens per document of a one-row packed scenario, in order."""
        row = self.doc_ids[0]
        starts = np.flatnonzero(np.diff(row, prepend=row[0] - 1))
        return np.diff(np.append(starts, row.size)).tolist()

    def collated(self) -> dict[str, Any]:
        """The packed row as the scenario's collator builds it from one feature per document."""
        assert self.collator is not None
        features = [{"input_ids": [1] * n} for n in self.document_lengths()]
        batch = self.collator(features)
        inputs = {
            key: torch.as_tensor(value) if isinstance(value, list) else value
            for key, value in batch.items()
            if key in MASK_INPUT_KEYS
        }
        shape = tuple(inputs["input_ids"].shape) if "input_ids" in inputs else None
        if shape != (1, self.seq_len):
            raise CollatorError(
                f"scenario '{self.name}': the collator {type(self.collator).__name__} returned "
                f"input_ids of shape {shape} for documents {self.document_lengths()}, not "
                f"(1, {self.seq_len}); a padding-free collator flattens them into one row"
            )
        return inputs


def _single_doc(batch: int, seq_len: int) -> np.ndarray:
    return np.zeros((batch, seq_len), dtype=np.int64)


def padded_doc_ids(lengths: list[int], seq_len: int, side: str) -> np.ndarray:
    doc_ids = np.full((len(lengths), seq_len), -1, dtype=np.int64)
    for row, length in enumerate(lengths):
        if side == "right":
            doc_ids[row, :length] = 0
        else:
            doc_ids[row, seq_len - length :] = 0
    return doc_ids


def packed_doc_ids(doc_lengths: list[int]) -> np.ndarray:
    return np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(doc_lengths)])[None]


def split_lengths(total: int, fractions: list[float]) -> list[int]:
    """Document lengths summing to `total`, in the given proportions (each at least 1)."""
    raw = [max(1, int(round(total * f / sum(fractions)))) for f in fractions]
    raw[-1] = total - sum(raw[:-1])
    if raw[-1] < 1:
        raise ValueError(f"cannot split {total} tokens into {len(fractions)} documents")
    return raw


def padded_lengths(seq_len: int, batch: int, pad_fraction: float) -> list[int]:
    """Real tokens per row of the padded scenarios: the first row full, the last short by
    `pad_fraction` of `seq_len`, the rows between in even steps (at least two rows)."""
    rows = max(2, batch)
    return [seq_len] + [
        max(1, seq_len - int(round(pad_fraction * seq_len * i / (rows - 1))))
        for i in range(1, rows)
    ]


def build_scenarios(
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    window: int | None,
    accepts_token_type_ids: bool,
    packed_collator: Collate | None = None,
) -> tuple[list[Scenario], list[str]]:
    """The scenarios asked for in mask.scenarios, and notes on the ones that do not apply. The
    packed one is laid out by `packed_collator` (default: transformers' flattening collator)."""
    batch = int(training_cfg["micro_batch_size"])
    seq_len = int(training_cfg["max_seq_len"])
    wanted = list(mask_cfg["scenarios"])
    notes: list[str] = []
    scenarios: list[Scenario] = []
    pad_lengths = padded_lengths(seq_len, batch, float(mask_cfg["pad_fraction"]))
    for name in wanted:
        if name == "train":
            scenarios.append(
                Scenario(name, "the training shape, unpadded", _single_doc(batch, seq_len))
            )
        elif name in ("below_window", "at_window", "above_window"):
            if window is None:
                notes.append(f"scenario {name} skipped: the model has no sliding-window layer")
                continue
            length = {"below_window": window - 1, "at_window": window, "above_window": window + 1}[
                name
            ]
            if length < 2:
                notes.append(f"scenario {name} skipped: window {window} too small")
                continue
            scenarios.append(
                Scenario(name, f"T={length} against window {window}", _single_doc(1, length))
            )
        elif name in ("right_padded", "left_padded"):
            side = name.split("_")[0]
            scenarios.append(
                Scenario(
                    name,
                    f"{side}-padded batch, lengths {pad_lengths}",
                    padded_doc_ids(pad_lengths, seq_len, side),
                    padding=side,
                )
            )
        elif name == "packed":
            lengths = split_lengths(seq_len, list(mask_cfg["packed_doc_fractions"]))
            scenarios.append(
                Scenario(
                    name,
                    f"one packed row, documents {lengths}",
                    packed_doc_ids(lengths),
                    packed=True,
                    collator=packed_collator or flattening_collator(),
                )
            )
        elif name == "token_type_ids":
            if not accepts_token_type_ids:
                notes.append(
                    "scenario token_type_ids skipped: not a multimodal wrapper taking them"
                )
                continue
            scenarios.append(
                Scenario(
                    name,
                    "the training shape with all-text token_type_ids (a multimodal processor's)",
                    _single_doc(batch, seq_len),
                    token_type_ids=True,
                )
            )
        else:
            raise ValueError(f"config key mask.scenarios: unknown scenario '{name}'")
    return scenarios, notes
