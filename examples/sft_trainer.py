"""The embedded default's trainer: a TRL ``SFTTrainer`` on Gemma 3 270M and the chitchat data.

This is what a user's own training script looks like, cut to the function the probes call:
``build_trainer(settings)`` builds the trainer exactly as training would (model, tokenizer,
dataset tokenized once through the chat template, LoRA via ``peft_config``, loss on assistant
turns) with the workflow's ``settings`` applied to its ``SFTConfig`` by
``probes.trainer.apply_settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# where the embedded default lies (the GPU evidence script points them at a random-init copy)
MODEL_DIR = Path(os.environ.get("PROBES_DEFAULT_MODEL", "resources/model/gemma-3-270m"))
DATA_FILE = Path(os.environ.get("PROBES_DEFAULT_DATA", "resources/data/chitchat.parquet"))


def tokenized(tokenizer: Any) -> Any:
    """The conversations tokenized once through the chat template with its assistant mask (what
    SFTTrainer's own tokenization does with assistant_only_loss), cached by datasets under a
    fingerprint of the data and tokenizer files: a restarted run (each probe builds the trainer
    anew) reads the cache instead of tokenizing again, and never hashes the 262k-token tokenizer
    (datasets' default fingerprint took 15-40 s of every build here)."""
    import hashlib

    import datasets

    digest = hashlib.sha256()
    for path in (DATA_FILE, MODEL_DIR / "tokenizer.json", MODEL_DIR / "chat_template.jinja"):
        if path.is_file():
            digest.update(path.read_bytes())
    dataset = datasets.Dataset.from_parquet(str(DATA_FILE), columns=["messages", "source"])
    # assistant_only_loss needs an assistant turn in every conversation (TRL refuses the rest)
    dataset = dataset.filter(
        lambda messages: any(m["role"] == "assistant" for m in messages),
        input_columns="messages",
        new_fingerprint=f"chitchat-assistant-{digest.hexdigest()[:16]}",
    )

    def tokenize(batch: dict[str, Any]) -> dict[str, Any]:
        # a batch of conversations at once: the same ids and masks as one by one (checked on
        # the default data), in half the time (the fast tokenizer encodes the batch together)
        out = tokenizer.apply_chat_template(
            batch["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    return dataset.map(
        tokenize,
        batched=True,
        batch_size=512,
        remove_columns=["messages"],
        new_fingerprint=f"chitchat-tokenized-batched-{digest.hexdigest()[:16]}",
        desc="Tokenizing (once; cached)",
    )


def build_trainer(settings: dict[str, Any]):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from probes.trainer import apply_settings, model_kwargs

    args = SFTConfig(
        output_dir="results/.trainer",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        max_length=4096,
        # the loss on assistant turns comes from the dataset's assistant_masks column (TRL
        # builds labels from it; its assistant_only_loss flag is for untokenized conversations)
        assistant_only_loss=False,
        activation_checkpointing=False,  # the current name (gradient_checkpointing deprecated)
        bf16=False,
        learning_rate=2e-4,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataset_num_proc=None,
    )
    args = apply_settings(args, settings)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(
        MODEL_DIR,
        **{"dtype": torch.float32, "attn_implementation": "sdpa", **model_kwargs(settings)},
    )
    dataset = tokenized(tokenizer)
    peft_config = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        task_type="CAUSAL_LM",
    )
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
