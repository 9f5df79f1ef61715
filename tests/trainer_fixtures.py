"""What a real transformers.Trainer run needs to show the padded tokens it feeds: a dataset of
examples with given lengths, a collator that records each micro-batch's shape, a tiny causal LM.

The one home of these pieces: tests/test_trainer_prediction.py and bench/apply_prediction.py
both run the Trainer with them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

VOCAB = 64


class TokenDataset(torch.utils.data.Dataset):
    """Examples of the given lengths (random token ids; only shapes matter)."""

    def __init__(self, lengths: np.ndarray, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.examples = [
            {"input_ids": rng.integers(1, VOCAB, size=int(n)).tolist()} for n in lengths
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


class RecordingCollator:
    """Pads each micro-batch to its longest row and records the shape fed to the model."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros((len(features), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            ids[row, :n] = torch.tensor(feature["input_ids"])
            mask[row, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        self.shapes.append(tuple(ids.shape))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    @property
    def padded_tokens(self) -> int:
        return int(sum(rows * width for rows, width in self.shapes))


def tiny_llama(max_len: int) -> transformers.PreTrainedModel:
    """A 2-layer Llama with tiny sizes, random init (seed 0): seconds per epoch on CPU."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
