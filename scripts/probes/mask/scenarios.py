"""The mask gate's scenarios: the batches each trace runs (the training shape, sequence lengths
around the sliding window, right/left padded, packed, token_type_ids) and the document ids that
say which positions belong together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probes.mask import band as mask_band

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

    @property
    def batch(self) -> int:
        return int(self.doc_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.doc_ids.shape[1])

    @property
    def n_docs(self) -> int:
        return int(max(len(set(row[row >= 0].tolist())) for row in self.doc_ids))

    def key_is_pad(self) -> torch.Tensor:
        return torch.from_numpy(self.doc_ids < 0)

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """What a collator hands the model: ids, a 2-D padding mask or restarting position ids."""
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


def build_scenarios(
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    window: int | None,
    accepts_token_type_ids: bool,
) -> tuple[list[Scenario], list[str]]:
    """The scenarios asked for in mask.scenarios, and notes on the ones that do not apply."""
    batch = int(training_cfg["micro_batch_size"])
    seq_len = int(training_cfg["max_seq_len"])
    wanted = list(mask_cfg["scenarios"])
    notes: list[str] = []
    scenarios: list[Scenario] = []
    pad_batch = max(2, batch)
    pad_fraction = float(mask_cfg["pad_fraction"])
    pad_lengths = [seq_len] + [
        max(1, seq_len - int(round(pad_fraction * seq_len * i / (pad_batch - 1))))
        for i in range(1, pad_batch)
    ]
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
