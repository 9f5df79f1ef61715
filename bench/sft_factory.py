"""The trainer factory bench/realized_vs_promised.py probes in ``--trainer sft`` mode: a
``trl.SFTTrainer`` on the bench's tokenised examples and model, built exactly as its realized
epochs build it, so the promise (the replay through this factory) and the realized epochs time
the same trainer. Reads the bench's run description from ``PROBES_BENCH_RUN`` (a JSON file).

Settings beyond SFTConfig's fields: ``bucket_size_batches`` (the length-grouped change: the
drop-in ``probes.sampler.length_grouped_trainer``) and ``drop_no_loss_examples``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

IGNORE_INDEX = -100


def build_trainer(settings: dict[str, Any]) -> Any:
    import datasets
    import trl
    from realized_setup import build_model

    from probes.sampler import length_grouped_trainer
    from probes.step.changes import checkpointing_field
    from probes.trainer import apply_settings

    run = json.loads(Path(os.environ["PROBES_BENCH_RUN"]).read_text())
    rows = json.loads(Path(run["rows"]).read_text())
    if settings.get("drop_no_loss_examples"):
        rows = [r for r in rows if any(r["completion_mask"])]
    config = trl.SFTConfig(
        output_dir=settings.get("output_dir", "unused"),
        per_device_train_batch_size=run["micro_batch_size"],
        gradient_accumulation_steps=run["grad_accum"],
        max_length=run["cap"],
        completion_only_loss=True,
        # SFTConfig's own defaults differ from TrainingArguments' (TRL 1.16: bf16 and gradient
        # checkpointing on); the bench's user trains without them
        **{checkpointing_field(): False},  # the installed name (no FutureWarning)
        bf16=False,
        use_cpu=run["device"] != "cuda",
        learning_rate=run["learning_rate"],
        seed=run["seed"],
        num_train_epochs=1,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    config = apply_settings(config, settings)
    architecture = Path(run["architecture"]) if run["architecture"] else None
    model = build_model(run["cap"], run["hidden"], architecture, None)
    if settings.get("attn_implementation"):  # what from_pretrained(attn_implementation=) sets
        model.set_attn_implementation(settings["attn_implementation"])
    common = {
        "model": model,
        "args": config,
        "train_dataset": datasets.Dataset.from_list(rows),
        "processing_class": tokenizer(run["vocab"]),
    }
    if settings.get("bucket_size_batches"):
        return length_grouped_trainer(trl.SFTTrainer)(
            **common, bucket_size_batches=int(settings["bucket_size_batches"])
        )
    return trl.SFTTrainer(**common)


def tokenizer(vocab_ids: int) -> Any:
    """A pad token over the bench model's ids (nothing is ever encoded)."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_ids)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
    )
