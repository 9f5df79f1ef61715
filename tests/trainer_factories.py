"""Trainer factories for tests: files a config's ``trainer.factory`` names, as a user writes them.

``write_factory`` writes one beside the test's data with the tiny model's directory and the data
file baked in: an ``SFTTrainer`` (LoRA via peft_config, loss on assistant turns) or a plain
``transformers.Trainer`` over a tokenized dataset (its own collator), optionally with a
per-micro-batch cost of known size added to ``compute_loss`` (what a harness would not see).
"""

from __future__ import annotations

from pathlib import Path

SFT = """
from pathlib import Path

MODEL_DIR = Path({model_dir!r})
DATA = Path({data!r})


def build_trainer(settings):
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from probes.trainer import apply_settings, model_kwargs

    args = SFTConfig(
        output_dir="unused",
        per_device_train_batch_size={micro},
        gradient_accumulation_steps={accum},
        max_length={max_length},
        assistant_only_loss=True,
        gradient_checkpointing=False,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
    )
    args = apply_settings(args, settings)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, **{{"dtype": torch.float32, **model_kwargs(settings)}}
    )
    dataset = datasets.load_dataset("json", data_files=str(DATA), split="train")
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft,
    )
"""

PLAIN = """
import time
from pathlib import Path

MODEL_DIR = Path({model_dir!r})
DATA = Path({data!r})
EXTRA_S = {extra_s!r}  # a per-micro-batch cost the reference harness would not see


def build_trainer(settings):
    import datasets
    import torch
    import transformers

    from probes.trainer import apply_settings, model_kwargs

    class SlowLossTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            time.sleep(EXTRA_S)
            return super().compute_loss(model, inputs, **kwargs)

    args = transformers.TrainingArguments(
        output_dir="unused",
        per_device_train_batch_size={micro},
        gradient_accumulation_steps={accum},
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
    )
    args = apply_settings(args, settings)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, **{{"dtype": torch.float32, **model_kwargs(settings)}}
    )
    rows = datasets.load_dataset("json", data_files=str(DATA), split="train")

    def tokenize(row):
        text = " ".join(m["content"] for m in row["messages"])
        ids = tokenizer(text, truncation=True, max_length={max_length})["input_ids"]
        return {{"input_ids": ids, "labels": ids}}

    dataset = rows.map(tokenize, remove_columns=["messages"])
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, padding=True)
    return SlowLossTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator
    )
"""


def write_factory(
    directory: Path,
    model_dir: Path,
    data: Path,
    kind: str = "sft",
    micro: int = 2,
    accum: int = 2,
    max_length: int = 128,
    extra_s: float = 0.0,
) -> str:
    """Write the factory file; returns the ``trainer.factory`` spec naming it."""
    template = {"sft": SFT, "plain": PLAIN}[kind]
    path = Path(directory) / f"{kind}_factory.py"
    path.write_text(
        template.format(
            model_dir=str(model_dir),
            data=str(data),
            micro=micro,
            accum=accum,
            max_length=max_length,
            extra_s=extra_s,
        )
    )
    return f"{path}:build_trainer"
