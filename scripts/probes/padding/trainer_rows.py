"""The lengths table from the user's own trainer: its prepared train dataset, not a second
tokenization. One row per row of ``trainer.train_dataset`` (example id = its row number, which
probes.step.trainer reads back), its tokens and the tokens that carry loss (``labels`` not
ignored, else TRL's ``completion_mask`` / ``assistant_masks``, else every token). Only ids,
counts and numbers leave the dataset.

What the trainer truncated it does not say: a row exactly ``max_length`` long is counted as
TRUNCATED (its full length unknown, ``n_tokens_full`` = ``n_tokens``); what it dropped before
the dataset was built (TRL drops examples with no loss token) is not in it and is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from probes.contracts import LENGTH_COLUMNS, OK, TRAINER_DATASET_FILE, TRUNCATED
from probes.errors import ProbeError

IGNORE_INDEX = -100
LOSS_MASK_COLUMNS = ("completion_mask", "assistant_masks")


class TrainerSettingsError(ProbeError, ValueError):
    """The trainer's own settings disagree with the config's training section."""


def loss_tokens(row: Mapping[str, Any], loss_on_all: bool) -> int:
    """Tokens of one prepared row that carry loss."""
    ids = row["input_ids"]
    if loss_on_all:
        return len(ids)
    labels = row.get("labels")
    if labels is not None:
        return int(np.count_nonzero(np.asarray(labels) != IGNORE_INDEX))
    for column in LOSS_MASK_COLUMNS:
        mask = row.get(column)
        if mask is not None:
            return int(np.count_nonzero(np.asarray(mask)))
    return len(ids)


def lengths_table(
    dataset: Any, max_length: int | None, loss_on_all: bool = False, source_column: str = "source"
) -> pd.DataFrame:
    """LENGTH_COLUMNS for every row of the trainer's prepared dataset, in its order."""
    columns = set(dataset.column_names)
    if "input_ids" not in columns:
        raise ProbeError(
            f"{TRAINER_DATASET_FILE}: no 'input_ids' column (columns {sorted(columns)}); the "
            "trainer's train dataset must be tokenized (SFTTrainer does it; for a plain "
            "Trainer, map your tokenizer over it in the factory)."
        )
    wanted = ["input_ids", *[c for c in ("labels", *LOSS_MASK_COLUMNS) if c in columns]]
    n_tokens, n_loss = [], []
    for row in dataset.select_columns(wanted):
        n_tokens.append(len(row["input_ids"]))
        n_loss.append(loss_tokens(row, loss_on_all))
    n = np.asarray(n_tokens, dtype=np.int64)
    truncated = (n >= max_length) if max_length else np.zeros(len(n), dtype=bool)
    sources = (
        [str(s) for s in dataset[source_column]] if source_column in columns else ["none"] * len(n)
    )
    turns = [len(m) for m in dataset["messages"]] if "messages" in columns else [np.nan] * len(n)
    table = pd.DataFrame(
        {
            "example_id": [str(i) for i in range(len(n))],
            "file": TRAINER_DATASET_FILE,
            "row": np.arange(1, len(n) + 1),
            "source": sources,
            "status": np.where(truncated, TRUNCATED, OK),
            "reason": np.where(truncated, "at_trainer_max_length", ""),
            "n_tokens": n,
            "n_tokens_full": n,
            "n_loss_tokens": np.asarray(n_loss, dtype=np.int64),
            "n_turns": turns,
            "n_truncated_tokens": 0,
        }
    )
    return table[list(LENGTH_COLUMNS)]


def settings_mismatches(args: Any, training: Any) -> list[str]:
    """Where the trainer's own arguments and the config's training section disagree."""
    pairs = [
        ("per_device_train_batch_size", "micro_batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
        ("max_length", "max_seq_len"),
    ]
    problems = []
    for field, key in pairs:
        value = getattr(args, field, None)
        if value is not None and int(value) != int(getattr(training, key)):
            problems.append(
                f"training.{key} is {getattr(training, key)} but the trainer's {field} is {value}"
            )
    return problems


def check_settings(args: Any, training: Any, spec: str, key: str = "trainer.factory") -> None:
    problems = settings_mismatches(args, training)
    if problems:
        raise TrainerSettingsError(
            f"{key} '{spec}': " + "; ".join(problems) + ". The probes price the run "
            "your trainer takes: set the training section to your trainer's values."
        )


def collator_check(trainer: Any, lengths: pd.DataFrame, n: int, seed: int = 0) -> dict[str, Any]:
    """The table against the trainer's own collator: each sampled row collated alone must give
    its tokens and loss tokens (labels not ignored) as the table counts them."""
    from probes.step.trainer import loader_inputs

    dataset, collator = loader_inputs(trainer, trainer.data_collator)
    rng = np.random.default_rng(seed)
    rows = sorted(rng.choice(len(lengths), size=min(n, len(lengths)), replace=False).tolist())
    mismatched = []
    for row in rows:
        batch = collator([dataset[row]])
        tokens = int(batch["input_ids"].shape[-1])
        labels = batch.get("labels")
        loss = int((labels != IGNORE_INDEX).sum()) if labels is not None else tokens
        expected = lengths.iloc[row]
        if tokens != int(expected["n_tokens"]) or loss != int(expected["n_loss_tokens"]):
            mismatched.append(
                {"example_id": str(expected["example_id"]), "tokens": tokens, "loss": loss}
            )
    return {
        "name": "trainer_collator_check",
        "description": "the lengths table gives the tokens and loss tokens the trainer's own "
        "collator builds for each sampled row",
        "expected": {"rows": len(rows), "mismatched": 0},
        "observed": {"rows": len(rows), "mismatched": len(mismatched), "first": mismatched[:5]},
        "passed": not mismatched,
    }
