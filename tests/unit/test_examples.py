"""The shipped example factory (examples/sft_trainer.py): its batched tokenization is the chat
template's one-by-one tokenization, ids and assistant masks alike."""

from __future__ import annotations

import importlib.util

import pandas as pd

from conftest import REPO, chat_rows


def load_example(monkeypatch, model_dir, data_file):
    monkeypatch.setenv("PROBES_DEFAULT_MODEL", str(model_dir))
    monkeypatch.setenv("PROBES_DEFAULT_DATA", str(data_file))
    spec = importlib.util.spec_from_file_location(
        "example_sft_trainer", REPO / "examples" / "sft_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batched_tokenization_equals_one_by_one(monkeypatch, tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = chat_rows(37)
    rows.append({"messages": [{"role": "user", "content": "no reply"}], "source": "src0"})
    data_file = tmp_path / "chat.parquet"
    pd.DataFrame(rows).to_parquet(data_file)
    example = load_example(monkeypatch, tiny_model_dir, data_file)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    dataset = example.tokenized(tokenizer)

    expected = [
        tokenizer.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        for row in rows[:-1]  # the conversation without an assistant turn is filtered out
    ]
    assert len(dataset) == len(expected)
    assert dataset["input_ids"] == [e["input_ids"] for e in expected]
    assert dataset["assistant_masks"] == [e["assistant_masks"] for e in expected]
    assert any(1 in mask for mask in dataset["assistant_masks"])
