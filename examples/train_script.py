"""A plain training script, code at top level: argparse, a ``transformers.Trainer``, ``train()``.

What many fine-tuning runs look like, with no function to import. The probes run it unmodified
(``trainer.command: [python, examples/train_script.py, ...]``, config/command-script.yaml): its
TrainingArguments get the workflow's settings, its ``from_pretrained`` the model settings, and its
``trainer.train()`` hands the trainer over; ``save_model`` below never runs under the probes.

By hand: ``python examples/train_script.py --model resources/model/gemma-3-270m \\
--data resources/data/chitchat.parquet --output_dir results/.train_script``
"""

import argparse

import datasets
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
)

IGNORE_INDEX = -100

parser = argparse.ArgumentParser(description="LoRA fine-tuning on chat data, loss on replies.")
parser.add_argument("--model", default="resources/model/gemma-3-270m")
parser.add_argument("--data", default="resources/data/chitchat.parquet")
parser.add_argument("--output_dir", default="results/.train_script")
parser.add_argument("--batch_size", type=int, default=2)
parser.add_argument("--grad_accum", type=int, default=8)
parser.add_argument("--max_length", type=int, default=4096)
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--lora_r", type=int, default=16)
parser.add_argument("--epochs", type=float, default=1.0)
cli = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(cli.model)
model = AutoModelForCausalLM.from_pretrained(
    cli.model, dtype=torch.float32, attn_implementation="sdpa"
)
model = get_peft_model(
    model,
    LoraConfig(
        r=cli.lora_r,
        lora_alpha=2 * cli.lora_r,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    ),
)

loader = "parquet" if cli.data.endswith(".parquet") else "json"
dataset = datasets.load_dataset(loader, data_files=cli.data, split="train")
dataset = dataset.filter(
    lambda messages: any(m["role"] == "assistant" for m in messages), input_columns="messages"
)


def tokenize(batch):
    """Each conversation through the chat template; labels only on the assistant's replies."""
    out = tokenizer.apply_chat_template(
        batch["messages"], return_dict=True, return_assistant_tokens_mask=True
    )
    ids = [row[: cli.max_length] for row in out["input_ids"]]
    masks = [row[: cli.max_length] for row in out["assistant_masks"]]
    labels = [
        [t if m else IGNORE_INDEX for t, m in zip(row, mask, strict=True)]
        for row, mask in zip(ids, masks, strict=True)
    ]
    return {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids], "labels": labels}


dataset = dataset.map(tokenize, batched=True, remove_columns=["messages"])

training_args = TrainingArguments(
    output_dir=cli.output_dir,
    per_device_train_batch_size=cli.batch_size,
    gradient_accumulation_steps=cli.grad_accum,
    learning_rate=cli.lr,
    num_train_epochs=cli.epochs,
    logging_steps=10,
    save_strategy="epoch",
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=dataset,
    data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX),
    processing_class=tokenizer,
)
trainer.train()
trainer.save_model()
