"""bench/realized_vs_promised.py's realized epochs on the harness path (``--trainer harness``):
a plain ``transformers.Trainer`` per configuration with exactly the change's emitted
``training_arguments`` (the drop-in length-grouped sampler where the change names it), or, for
TRL packing, a ``trl.SFTTrainer`` with its ``sft_config``; one whole epoch each, timed by the
Trainer's own ``train_runtime``."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from realized_setup import (
    IGNORE_INDEX,
    VOCAB,
    Examples,
    build_model,
    epoch_arguments,
    model_dtype,
    vocab_size,
)

from probes.batching import plans as pl


def collate(features: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Right padding to the micro-batch's longest row (as the replay's padded batches)."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros((len(features), width), dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = torch.tensor(f["input_ids"])
        labels[row, :n] = torch.tensor(f["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def keep_example(example: dict[str, list[int]]) -> bool:
    """The filter recommendations.json's drop_no_loss_examples snippet pastes."""
    return any(label != IGNORE_INDEX for label in example["labels"])


def run_epoch(
    name: str,
    change: dict[str, Any] | None,
    base_kwargs: dict[str, Any],
    data: Examples,
    args: argparse.Namespace,
) -> dict[str, float]:
    import transformers

    from probes.sampler import length_grouped_trainer

    if change and change.get("training_arguments") is None:
        return run_sft_epoch(change, data, args)  # TRL only (packing)
    kwargs = dict(change["training_arguments"]) if change else dict(base_kwargs)
    dataset = data.filter(keep_example) if name == "drop_no_loss_examples" else data
    with tempfile.TemporaryDirectory() as out:
        training_args = transformers.TrainingArguments(**epoch_arguments(out, args), **kwargs)
        common = {
            "model": build_model(args.cap, args.hidden, args.architecture, model_dtype(args)),
            "args": training_args,
            "train_dataset": dataset,
            "data_collator": collate,
        }
        sampler = (change or {}).get("sampler")
        if sampler:
            trainer = length_grouped_trainer(transformers.Trainer)(
                **common, bucket_size_batches=int(sampler["kwargs"]["bucket_size_batches"])
            )
        else:
            trainer = transformers.Trainer(**common)
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def tiny_tokenizer(vocab_ids: int = VOCAB) -> Any:
    """What SFTTrainer needs of a tokenizer for already-tokenised data: a pad token, over the
    bench model's VOCAB ids (one word per id; nothing is ever encoded)."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_ids)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
    )


def run_sft_epoch(change: dict[str, Any], data: Examples, args: argparse.Namespace) -> dict:
    """One epoch of trl.SFTTrainer with exactly the change's sft_config (TRL packing), on the
    same tokenised examples: input_ids and a completion mask (loss on the assistant tokens, as
    the labels of the Trainer runs)."""
    import datasets
    import trl

    from probes.step.changes import checkpointing_field

    rows = [
        {
            "input_ids": r["input_ids"],
            "completion_mask": [int(label != IGNORE_INDEX) for label in r["labels"]],
        }
        for r in data.rows
    ]
    with tempfile.TemporaryDirectory() as out:
        # SFTConfig's defaults are not TrainingArguments' (TRL 1.16: bf16=True,
        # gradient_checkpointing=True). bf16 comes from precision() (off on CPU: emulated
        # without bf16 units, no valid timing); checkpointing off under its installed name (no
        # FutureWarning) unless the change's sft_config states the run's own, as it does
        config = trl.SFTConfig(
            **{
                **epoch_arguments(out, args),
                "completion_only_loss": True,
                checkpointing_field(): False,
                **change["sft_config"],
            }
        )
        trainer = trl.SFTTrainer(
            model=build_model(args.cap, args.hidden, args.architecture, model_dtype(args)),
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tiny_tokenizer(vocab_size(args)),
        )
        metrics = trainer.train().metrics
        return {
            "train_runtime": float(metrics["train_runtime"]),
            "optimizer_steps": int(trainer.state.global_step),
        }


def run_realized(
    changes: list[dict[str, Any]],
    base_kwargs: dict[str, Any],
    data: Examples,
    args: argparse.Namespace,
) -> dict[str, list[dict[str, float]]]:
    """The baseline (`base_kwargs`) and every change in `changes`, one epoch each per round."""
    configs: list[tuple[str, dict[str, Any] | None]] = [(pl.BASELINE, None)]
    configs += [(c["id"], c) for c in changes]
    # one untimed epoch first: the process's first Trainer (and first SFTTrainer) pays one-time
    # costs (imports, the datasets cache)
    warm = Examples(data.rows[: max(len(data) // 4, 16)])
    run_epoch(pl.BASELINE, None, base_kwargs, warm, args)
    for change in changes:
        if change.get("training_arguments") is None:
            run_epoch(change["id"], change, base_kwargs, warm, args)
            break
    return rounds(configs, lambda name, c: run_epoch(name, c, base_kwargs, data, args), args)


def rounds(
    configs: list[tuple[str, Any]], run_one: Callable[[str, Any], dict], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """`args.repeats` rounds of one epoch of every configuration, in a new seeded order each
    round (drift shared): {name: [run_one(name, what) per round]}."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    rng = np.random.default_rng(args.seed + 11)
    for repeat in range(args.repeats):
        for i in rng.permutation(len(configs)):
            name, what = configs[i]
            result = run_one(name, what)
            runs[name].append(result)
            print(
                f"  round {repeat + 1}/{args.repeats} {name:<26s} "
                f"{result['train_runtime']:7.2f} s, {result['optimizer_steps']} steps",
                flush=True,
            )
    return runs
