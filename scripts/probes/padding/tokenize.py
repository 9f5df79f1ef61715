"""Tokenize training data the way training does, fast, and count its loss tokens.

Training renders each conversation with the chat template and tokenizes the rendered text without
adding special tokens (the template writes them): `apply_chat_template(tokenize=True)`. This module
does the same in two batched passes instead of one Python call per example:

1. render every conversation once with the template, recording the character spans that the
   template's `{% generation %}` tags mark as assistant output (transformers' own renderer);
2. encode all rendered texts with the Rust tokenizer's `encode_batch` and map the assistant
   character spans onto tokens with vectorised numpy over the token offsets, using the rule
   transformers uses for `return_assistant_tokens_mask` (a token counts if it overlaps a span).

The tokenizer and template are loaded and checked by ``probes.padding.tokenizer``.
`reference_counts` is the slow per-example path through `apply_chat_template`; the stage's control
checks the fast path against it. Nothing here logs or returns example text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from probes.contracts import ERROR, OK, TRUNCATED
from probes.padding.data import Example
from probes.padding.tokenizer import TokenizeError, check_template, rust_backend, template_kwargs

LOSS_ON = ("assistant", "all")

# Reason codes this module adds to the loader's (never text from the data).
REASON_TEMPLATE_ERROR = "chat_template_error"
REASON_TRUNCATED = "longer_than_max_seq_len"
REASON_NO_LOSS_TOKENS = "no_loss_tokens"


def _as_messages(example: Example) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in example.messages or ()]


@dataclass
class Rendered:
    """Rendered texts and assistant char spans of the examples that rendered; failures by index."""

    index: list[int]  # positions in the input list
    texts: list[str]
    spans: list[list[tuple[int, int]]]
    failed: list[int]


def render_chats(
    examples: Sequence[Example],
    template: str,
    kwargs: dict[str, Any],
    batch_size: int = 256,
    progress: bool = True,
) -> Rendered:
    """Render chat examples with the template, keeping assistant char spans.

    A conversation the template rejects (e.g. it raises on role order) is reported by index, not
    raised: the stage counts it as ERROR and goes on. The exception text is dropped because
    templates often quote the offending message.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    result = Rendered([], [], [], [])

    def render(batch_indices: list[int]) -> tuple[list[str], list[Any]]:
        texts, spans = render_jinja_template(
            conversations=[_as_messages(examples[i]) for i in batch_indices],
            chat_template=template,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
        return texts, spans

    indices = list(range(len(examples)))
    with tqdm(total=len(indices), desc="render", unit="ex", disable=not progress) as bar:
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            try:
                pairs = list(zip(batch, *render(batch), strict=True))
            except Exception:  # isolate the failing conversations one by one
                pairs = []
                for i in batch:
                    try:
                        texts, spans = render([i])
                        pairs.append((i, texts[0], spans[0]))
                    except Exception:
                        result.failed.append(i)
            for i, text, spans in pairs:
                result.index.append(i)
                result.texts.append(text)
                result.spans.append(sorted((int(a), int(b)) for a, b in spans))
            bar.update(len(batch))
    return result


@dataclass
class TokenCounts:
    """Per text: tokens, and loss tokens among all tokens and among the first max_seq_len."""

    n_tokens_full: np.ndarray
    n_loss_full: np.ndarray
    n_loss_kept: np.ndarray
    n_offset_fallback: int = 0  # texts counted from full offsets (boundary lookup undecided)


def loss_token_counts(
    starts: np.ndarray,
    ends: np.ndarray,
    token_counts: np.ndarray,
    spans: Sequence[Sequence[tuple[int, int]]],
    max_seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Loss tokens per text from flat token offsets (texts concatenated) and char spans per text.

    A token counts if it overlaps a span (token_end > span_start and token_start < span_end), the
    rule of transformers' `return_assistant_tokens_mask`. Vectorised: every position is shifted by
    its text's index times a stride longer than any text, so one searchsorted over all spans of all
    texts finds, per token, the first span ending after the token starts. Returns (loss tokens in
    the whole text, loss tokens among its first `max_seq_len` tokens).
    """
    n_texts = len(token_counts)
    token_counts = np.asarray(token_counts, dtype=np.int64)
    if n_texts == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    text_of_token = np.repeat(np.arange(n_texts, dtype=np.int64), token_counts)
    first_token = np.concatenate(([0], np.cumsum(token_counts)[:-1]))
    position = np.arange(len(text_of_token), dtype=np.int64) - first_token[text_of_token]

    span_counts = np.fromiter((len(s) for s in spans), dtype=np.int64, count=n_texts)
    flat = np.fromiter(
        chain.from_iterable(chain.from_iterable(spans)), np.int64, count=2 * int(span_counts.sum())
    ).reshape(-1, 2)
    stride = int(max(ends.max(initial=0), flat.max(initial=0))) + 1
    text_of_span = np.repeat(np.arange(n_texts, dtype=np.int64), span_counts)
    span_start = flat[:, 0] + text_of_span * stride
    span_end = flat[:, 1] + text_of_span * stride
    token_start = starts.astype(np.int64) + text_of_token * stride
    token_end = ends.astype(np.int64) + text_of_token * stride

    # Spans of one text are sorted and disjoint, and texts are stride apart: span_end is sorted.
    first_span = np.searchsorted(span_end, token_start, side="right")
    has_span = first_span < len(span_end)
    in_span = np.zeros(len(token_start), dtype=bool)
    in_span[has_span] = token_end[has_span] > span_start[first_span[has_span]]

    loss_full = np.bincount(text_of_token, weights=in_span, minlength=n_texts).astype(np.int64)
    kept = in_span & (position < max_seq_len)
    loss_kept = np.bincount(text_of_token, weights=kept, minlength=n_texts).astype(np.int64)
    return loss_full, loss_kept


def _batches(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(start + size, n))


def span_counts_by_lookup(
    encoding: Any, text_length: int, spans: Sequence[tuple[int, int]], max_seq_len: int
) -> tuple[int, int] | None:
    """Loss tokens of one encoding from a few Rust lookups at the span boundaries, or None.

    For offsets that never decrease (what the Rust tokenizer produces for one sequence), the
    tokens overlapping [a, b) are those from Q(a) = #{token_end <= a} to P(b) = #{token_start < b}.
    When a token starts exactly at a boundary char, `char_to_token` at that char gives Q or P
    directly (for P, the token before must start before b, which rules out zero-width tokens).
    Chat templates put span boundaries at token starts; when a boundary falls inside a token or
    in an uncovered gap this returns None and the caller counts from the full offsets instead.
    """
    n = len(encoding)
    full = kept = 0
    for a, b in spans:
        if a >= b:
            return None
        if a >= text_length:
            q = n
        else:
            q = encoding.char_to_token(a)
            if q is None or encoding.token_to_chars(q)[0] != a:
                return None
        if b >= text_length:
            p = n
        else:
            p = encoding.char_to_token(b)
            if p is None or encoding.token_to_chars(p)[0] != b:
                return None
            if p > 0 and encoding.token_to_chars(p - 1)[0] >= b:
                return None
        if p < q:
            return None
        full += p - q
        kept += max(0, min(p, max_seq_len) - min(q, max_seq_len))
    return full, kept


def encode_and_count(
    texts: Sequence[str],
    spans: Sequence[Sequence[tuple[int, int]]] | None,
    backend: Any,
    max_seq_len: int,
    add_special_tokens: bool,
    batch_size: int = 1024,
    progress: bool = True,
    desc: str = "tokenize",
) -> TokenCounts:
    """Encode texts with the Rust `encode_batch` and count loss tokens.

    `spans=None` means every token is a loss token (loss_on=all, or plain text). With spans, each
    encoding is counted by boundary lookups (`span_counts_by_lookup`); the few it cannot settle
    are counted from their full offsets (`loss_token_counts`), which is exact but copies every
    offset into Python.
    """
    n = len(texts)
    n_full = np.zeros(n, np.int64)
    loss_full = np.zeros(n, np.int64)
    loss_kept = np.zeros(n, np.int64)
    n_fallback = 0
    with tqdm(total=n, desc=desc, unit="ex", disable=not progress) as bar:
        for batch in _batches(n, batch_size):
            encodings = backend.encode_batch(
                [texts[i] for i in batch], add_special_tokens=add_special_tokens
            )
            counts = np.fromiter((len(e) for e in encodings), np.int64, count=len(batch))
            n_full[batch.start : batch.stop] = counts
            if spans is None:
                loss_full[batch.start : batch.stop] = counts
                loss_kept[batch.start : batch.stop] = np.minimum(counts, max_seq_len)
                bar.update(len(batch))
                continue
            fallback = []
            for j, i in enumerate(batch):
                found = span_counts_by_lookup(encodings[j], len(texts[i]), spans[i], max_seq_len)
                if found is None:
                    fallback.append(j)
                else:
                    loss_full[i], loss_kept[i] = found
            if fallback:
                n_fallback += len(fallback)
                sub_counts = counts[fallback]
                flat = np.fromiter(
                    chain.from_iterable(
                        chain.from_iterable(encodings[j].offsets for j in fallback)
                    ),
                    np.int64,
                    count=2 * int(sub_counts.sum()),
                ).reshape(-1, 2)
                full, kept = loss_token_counts(
                    flat[:, 0],
                    flat[:, 1],
                    sub_counts,
                    [spans[batch.start + j] for j in fallback],
                    max_seq_len,
                )
                where = np.asarray(fallback, dtype=np.int64) + batch.start
                loss_full[where] = full
                loss_kept[where] = kept
            bar.update(len(batch))
    return TokenCounts(n_full, loss_full, loss_kept, n_fallback)


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: Any,
    template: str | None,
    max_seq_len: int,
    loss_on: str = "assistant",
    batch_size: int = 1024,
    progress: bool = True,
) -> pd.DataFrame:
    """The lengths table: one row per example (every status), columns LENGTH_COLUMNS + extras.

    Chat rows are rendered with the template and encoded without added special tokens (as
    `apply_chat_template(tokenize=True)` does); plain-text rows are encoded with them (as
    `tokenizer(text)` does) and all their tokens are loss tokens. Kept tokens are the first
    `max_seq_len` (right truncation).
    """
    if loss_on not in LOSS_ON:
        raise TokenizeError(f"training.loss_on must be one of {LOSS_ON}, got '{loss_on}'.")
    ok_chat = [i for i, e in enumerate(examples) if e.status == OK and e.is_chat]
    ok_text = [i for i, e in enumerate(examples) if e.status == OK and not e.is_chat]
    check_template(template, loss_on, len(ok_chat))
    backend = rust_backend(tokenizer)

    n = len(examples)
    n_full = np.zeros(n, np.int64)
    loss_full = np.zeros(n, np.int64)
    loss_kept = np.zeros(n, np.int64)
    template_failed: set[int] = set()
    n_fallback = 0

    if ok_chat:
        rendered = render_chats(
            [examples[i] for i in ok_chat],
            template or "",
            template_kwargs(tokenizer),
            batch_size=max(1, batch_size // 4),
            progress=progress,
        )
        template_failed = {ok_chat[j] for j in rendered.failed}
        counts = encode_and_count(
            rendered.texts,
            rendered.spans if loss_on == "assistant" else None,
            backend,
            max_seq_len,
            add_special_tokens=False,
            batch_size=batch_size,
            progress=progress,
        )
        n_fallback += counts.n_offset_fallback
        where = np.asarray([ok_chat[j] for j in rendered.index], dtype=np.int64)
        n_full[where] = counts.n_tokens_full
        loss_full[where] = counts.n_loss_full
        loss_kept[where] = counts.n_loss_kept
    if ok_text:
        counts = encode_and_count(
            [examples[i].text or "" for i in ok_text],
            None,
            backend,
            max_seq_len,
            add_special_tokens=True,
            batch_size=batch_size,
            progress=progress,
            desc="tokenize text",
        )
        where = np.asarray(ok_text, dtype=np.int64)
        n_full[where] = counts.n_tokens_full
        loss_full[where] = counts.n_loss_full
        loss_kept[where] = counts.n_loss_kept

    table = lengths_table(examples, n_full, loss_full, loss_kept, template_failed, max_seq_len)
    table.attrs["n_offset_fallback"] = n_fallback
    return table


def lengths_table(
    examples: Sequence[Example],
    n_tokens_full: np.ndarray,
    n_loss_full: np.ndarray,
    n_loss_kept: np.ndarray,
    template_failed: set[int],
    max_seq_len: int,
) -> pd.DataFrame:
    """Assign final statuses (TRUNCATED, template ERROR) and build the lengths table.

    Counts of rows that are not usable (EMPTY, ERROR) are zeroed; kept tokens are the first
    `max_seq_len`.
    """
    statuses, reasons = [], []
    for i, example in enumerate(examples):
        status, reason = example.status, example.reason
        if i in template_failed:
            status, reason = ERROR, REASON_TEMPLATE_ERROR
        elif status == OK and n_tokens_full[i] > max_seq_len:
            status, reason = TRUNCATED, REASON_TRUNCATED
        elif status == OK and n_loss_kept[i] == 0:
            reason = REASON_NO_LOSS_TOKENS
        statuses.append(status)
        reasons.append(reason)
    usable = np.isin(np.asarray(statuses, dtype=object), (OK, TRUNCATED))
    n_full = np.where(usable, np.asarray(n_tokens_full, dtype=np.int64), 0)
    n_kept = np.minimum(n_full, max_seq_len)
    return pd.DataFrame(
        {
            "example_id": [e.example_id for e in examples],
            "file": [e.file for e in examples],
            "row": np.asarray([e.row for e in examples], dtype=np.int64),
            "source": [e.source for e in examples],
            "status": statuses,
            "reason": reasons,
            "n_tokens": n_kept,
            "n_tokens_full": n_full,
            "n_loss_tokens": np.where(usable, np.asarray(n_loss_kept, dtype=np.int64), 0),
            "n_turns": np.asarray([e.n_turns for e in examples], dtype=np.int64),
            "n_truncated_tokens": n_full - n_kept,
            "n_loss_tokens_full": np.where(usable, np.asarray(n_loss_full, dtype=np.int64), 0),
            "kind": [
                "chat" if e.is_chat else ("text" if e.text is not None else "") for e in examples
            ],
        }
    )


def reference_counts(
    example: Example,
    tokenizer: Any,
    template: str | None,
    max_seq_len: int,
    loss_on: str = "assistant",
) -> tuple[int, int]:
    """(tokens, loss tokens among the first max_seq_len) the slow way training's own call gives.

    Chat: `apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`; text:
    `tokenizer(text)`. Used by the control to check the batched path, example by example.
    """
    if example.is_chat:
        out = tokenizer.apply_chat_template(
            _as_messages(example),
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=loss_on == "assistant",
        )
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"]) if loss_on == "assistant" else [1] * len(ids)
    else:
        ids = list(tokenizer(example.text or "")["input_ids"])
        mask = [1] * len(ids)
    return len(ids), int(sum(mask[:max_seq_len]))
