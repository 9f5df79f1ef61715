"""Batched tokenization and loss-token counting against training's own per-example path."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHAT_TEMPLATE, chat_rows, write_jsonl
from probes.padding.data import load_file
from probes.padding.tokenize import (
    loss_token_counts,
    reference_counts,
    span_counts_by_lookup,
    tokenize_examples,
)
from probes.padding.tokenizer import (
    TokenizeError,
    load_tokenizer,
    resolve_chat_template,
    rust_backend,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def chat_examples(tmp_path):
    rows = chat_rows(30)
    rows.append({"messages": [{"role": "user", "content": "hello"}], "source": "solo"})  # no loss
    return load_file(write_jsonl(tmp_path / "chat.jsonl", rows))


def naive_mask_counts(offsets, spans, max_seq_len):
    """transformers' return_assistant_tokens_mask loop, token by token."""
    mask = []
    span_idx = 0
    for start, end in offsets:
        while span_idx < len(spans) and start >= spans[span_idx][1]:
            span_idx += 1
        mask.append(span_idx < len(spans) and end > spans[span_idx][0])
    return sum(mask), sum(mask[:max_seq_len])


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
@pytest.mark.parametrize("max_seq_len", [4096, 40])
def test_batched_counts_equal_apply_chat_template(tokenizer, chat_examples, loss_on, max_seq_len):
    template = resolve_chat_template(tokenizer, None)
    lengths = tokenize_examples(
        chat_examples, tokenizer, template, max_seq_len, loss_on, batch_size=7, progress=False
    )
    assert len(lengths) == len(chat_examples)
    for example, row in zip(chat_examples, lengths.itertuples(), strict=True):
        n_full, n_loss = reference_counts(example, tokenizer, template, max_seq_len, loss_on)
        assert row.n_tokens_full == n_full
        assert row.n_loss_tokens == n_loss
        assert row.n_tokens == min(n_full, max_seq_len)
        assert row.n_truncated_tokens == n_full - row.n_tokens
        assert row.status == ("TRUNCATED" if n_full > max_seq_len else "OK")
    if max_seq_len == 40:
        assert (lengths["status"] == "TRUNCATED").any()
    if loss_on == "assistant":
        solo = lengths[lengths["source"] == "solo"].iloc[0]
        assert solo["n_loss_tokens"] == 0 and solo["reason"] == "no_loss_tokens"


def test_plain_text_rows_are_tokenized_with_special_tokens(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello how are you"}, {"text": "pizza"}])
    examples = load_file(path)
    lengths = tokenize_examples(examples, tokenizer, None, 4096, "assistant", progress=False)
    expected = [len(tokenizer(e.text)["input_ids"]) for e in examples]
    assert lengths["n_tokens"].tolist() == expected
    assert lengths["n_loss_tokens"].tolist() == expected  # no roles: every token trains


def test_template_without_generation_tags_is_refused_for_assistant_loss(tokenizer, chat_examples):
    plain = (
        CHAT_TEMPLATE.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", "")
    )
    with pytest.raises(TokenizeError, match="generation"):
        tokenize_examples(chat_examples, tokenizer, plain, 4096, "assistant", progress=False)
    lengths = tokenize_examples(chat_examples, tokenizer, plain, 4096, "all", progress=False)
    assert (lengths["n_loss_tokens"] == lengths["n_tokens"]).all()


def test_missing_template_names_the_config_key(tokenizer, chat_examples):
    with pytest.raises(TokenizeError, match="model.chat_template"):
        tokenize_examples(chat_examples, tokenizer, None, 4096, "assistant", progress=False)


def test_conversation_the_template_rejects_is_an_error_row(tokenizer, tmp_path):
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn') }}{% endif %}"
        + CHAT_TEMPLATE.read_text()
    )
    rows = chat_rows(5)
    rows[2] = {"messages": [{"role": "assistant", "content": "hello"}]}
    examples = load_file(write_jsonl(tmp_path / "c.jsonl", rows))
    lengths = tokenize_examples(examples, tokenizer, strict, 4096, "assistant", progress=False)
    assert lengths.loc[2, "status"] == "ERROR"
    assert lengths.loc[2, "reason"] == "chat_template_error"
    assert lengths.loc[2, "n_tokens"] == 0
    assert (lengths.drop(index=2)["status"] == "OK").all()


def test_spans_inside_tokens_fall_back_to_offsets_and_stay_exact(tokenizer, tmp_path):
    # The generation tag opens mid-word ("model" + content glued into one unknown word), so the
    # boundary lookup cannot decide and the offsets path must count it.
    glued = CHAT_TEMPLATE.read_text().replace(
        "'<start_of_turn>model\\n' }}", "'<start_of_turn>mo' }}"
    )
    glued = glued.replace("{% generation %}", "{% generation %}{{ 'del' }}")
    assert glued != CHAT_TEMPLATE.read_text()
    examples = load_file(write_jsonl(tmp_path / "c.jsonl", chat_rows(6)))
    lengths = tokenize_examples(examples, tokenizer, glued, 4096, "assistant", progress=False)
    assert lengths.attrs["n_offset_fallback"] > 0
    for example, row in zip(examples, lengths.itertuples(), strict=True):
        assert (row.n_tokens_full, row.n_loss_tokens) == reference_counts(
            example, tokenizer, glued, 4096
        )


def test_loss_token_counts_match_the_token_loop_on_odd_offsets():
    rng = np.random.default_rng(0)
    texts_offsets, texts_spans = [], []
    for _ in range(200):
        n_tokens = int(rng.integers(1, 40))
        starts = np.sort(rng.integers(0, 120, size=n_tokens))
        widths = rng.integers(0, 4, size=n_tokens)  # zero-width tokens and gaps
        offsets = [(int(s), int(s + w)) for s, w in zip(starts, widths, strict=True)]
        cuts = np.sort(
            rng.choice(np.arange(0, 130), size=2 * int(rng.integers(0, 4)), replace=False)
        )
        spans = [(int(cuts[i]), int(cuts[i + 1])) for i in range(0, len(cuts), 2)]
        texts_offsets.append(offsets)
        texts_spans.append(spans)
    counts = np.array([len(o) for o in texts_offsets])
    flat = np.array([pair for offsets in texts_offsets for pair in offsets])
    for max_seq_len in (5, 1000):
        full, kept = loss_token_counts(flat[:, 0], flat[:, 1], counts, texts_spans, max_seq_len)
        for i, (offsets, spans) in enumerate(zip(texts_offsets, texts_spans, strict=True)):
            assert (full[i], kept[i]) == naive_mask_counts(offsets, spans, max_seq_len)


def test_boundary_lookup_is_exact_or_declines(tokenizer):
    backend = rust_backend(tokenizer)
    text = "<bos>hello how are you today<end_of_turn>\npizza pasta the a of<end_of_turn>\n"
    encoding = backend.encode_batch([text], add_special_tokens=False)[0]
    rng = np.random.default_rng(1)
    token_starts = sorted({start for start, _ in encoding.offsets} | {len(text)})
    anywhere = list(range(len(text) + 1))
    decided = 0
    for trial in range(300):
        # half the spans on token starts (decidable), half anywhere (often not)
        pool = token_starts if trial % 2 else anywhere
        a, b = sorted(int(x) for x in rng.choice(pool, 2, replace=False))
        for max_seq_len in (3, 100):
            found = span_counts_by_lookup(encoding, len(text), [(a, b)], max_seq_len)
            if found is not None:
                decided += 1
                assert found == naive_mask_counts(encoding.offsets, [(a, b)], max_seq_len)
    assert decided > 50
