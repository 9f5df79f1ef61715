"""Loading training data the way a user brings it, with every row accounted for.

Formats: JSONL or Parquet rows holding OpenAI-style `messages` [{role, content}], ShareGPT
`conversations` [{from, value}] or plain `text`. Each row becomes one `Example` whose status is
OK, EMPTY or ERROR; malformed rows keep their file and line/row number and a reason code, and are
never dropped. Reason codes never contain text from the data.

Reason codes (stable: summaries and users' scripts match on them). In the turn codes, `role` and
`content` also stand for ShareGPT's `from` and `value`; a null field counts as missing, because
Parquet cannot tell the two apart.

| code | status | the row |
|---|---|---|
| `not_utf8`, `invalid_json` | ERROR | a JSONL line that is not UTF-8 / not JSON |
| `row_not_an_object` | ERROR | is not a JSON object |
| `no_messages_conversations_or_text` | ERROR | has none of the three fields |
| `text_null`, `text_empty` | EMPTY | `text` is null / only whitespace |
| `text_not_a_string` | ERROR | `text` is not a string |
| `turns_not_a_list` | ERROR | `messages` / `conversations` is not a list |
| `turn_not_an_object` | ERROR | a turn is not an object |
| `role_missing` | ERROR | a turn has no role (`role` / `from`) |
| `unknown_role` | ERROR | a turn's role is not a string or not one of ROLE_ALIASES |
| `content_missing` | ERROR | a turn has no content (`content` / `value`) |
| `content_not_a_string` | ERROR | a turn's content is not a string (e.g. a list of parts) |
| `no_content` | EMPTY | no turns, or every turn's content is only whitespace |
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from probes.contracts import EMPTY, ERROR, OK, STATUSES
from probes.errors import ProbeError

NO_SOURCE = "none"

# ShareGPT and other common spellings, mapped onto the chat-template roles.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}


class DataError(ProbeError, ValueError):
    """The data cannot be used at all; the message names the file and what to do."""


@dataclass(frozen=True)
class Example:
    """One row of the user's data. `row` is the 1-based line (JSONL) or row number (Parquet)."""

    example_id: str
    file: str
    row: int
    source: str
    status: str
    reason: str = ""
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) for chat data
    text: str | None = None  # plain-text data
    n_turns: int = 0

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def display_name(path: str | Path) -> str:
    """A data file as the user named it: relative to the working directory where it lies under
    it, else as given. Two files with one basename (a/train.jsonl, b/train.jsonl) stay apart."""
    path = Path(path)
    if path.is_absolute():
        try:
            return path.relative_to(Path.cwd()).as_posix()
        except ValueError:
            return path.as_posix()
    return path.as_posix()


def example_id(file_name: str, row: int, payload: str) -> str:
    """A stable id from where the row is (the file as display_name gives it, the row) and what
    it holds; never the text itself. Unique across the files of one run."""
    digest = hashlib.sha256(f"{file_name}\x00{row}\x00{payload}".encode()).hexdigest()
    return digest[:16]


def turn_reason(turn: Any, role_key: str, content_key: str) -> str:
    """The reason code of a malformed turn, or "" for a usable one. Checked in this order, so a
    turn with several faults gets the first: object, role (missing, then known), content."""
    if not isinstance(turn, dict):
        return "turn_not_an_object"
    role = turn.get(role_key)
    if role is None:
        return "role_missing"
    if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
        return "unknown_role"
    content = turn.get(content_key)
    if content is None:
        return "content_missing"
    if not isinstance(content, str):
        return "content_not_a_string"
    return ""


def parse_record(record: Any, file_name: str, row: int, source: str, payload: str) -> Example:
    """Turn one decoded row into an Example with status OK, EMPTY or ERROR."""
    ident = example_id(file_name, row, payload)

    def bad(reason: str) -> Example:
        return Example(ident, file_name, row, source, ERROR, reason)

    if not isinstance(record, dict):
        return bad("row_not_an_object")
    if record.get("messages") is not None:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif record.get("conversations") is not None:
        turns, role_key, content_key = record["conversations"], "from", "value"
    elif "text" in record:
        text = record["text"]
        if text is None:
            return Example(ident, file_name, row, source, EMPTY, "text_null")
        if not isinstance(text, str):
            return bad("text_not_a_string")
        if not text.strip():
            return Example(ident, file_name, row, source, EMPTY, "text_empty")
        return Example(ident, file_name, row, source, OK, text=text, n_turns=1)
    else:
        return bad("no_messages_conversations_or_text")

    if not isinstance(turns, (list, tuple)):
        return bad("turns_not_a_list")
    messages: list[tuple[str, str]] = []
    for turn in turns:
        reason = turn_reason(turn, role_key, content_key)
        if reason:
            return bad(reason)
        messages.append((ROLE_ALIASES[turn[role_key].strip().lower()], turn[content_key]))
    if not messages or not any(content.strip() for _, content in messages):
        return Example(ident, file_name, row, source, EMPTY, "no_content")
    return Example(
        ident, file_name, row, source, OK, messages=tuple(messages), n_turns=len(messages)
    )


def _row_source(record: Any, file_source: str | None, source_column: str) -> str:
    if file_source:
        return file_source
    if isinstance(record, dict):
        value = record.get(source_column)
        if isinstance(value, str) and value.strip():
            return value
    return NO_SOURCE


UTF8_BOM = b"\xef\xbb\xbf"


def iter_jsonl(path: Path, file_source: str | None, source_column: str) -> Iterator[Example]:
    name = display_name(path)
    # Bytes, not text mode: a non-UTF-8 byte makes one line an ERROR, not the whole file.
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            payload_bytes = raw.strip()
            if line_number == 1 and payload_bytes.startswith(UTF8_BOM):  # an editor's BOM
                payload_bytes = payload_bytes[len(UTF8_BOM) :].strip()
            if not payload_bytes:
                continue  # blank lines are not rows
            try:
                payload = payload_bytes.decode("utf-8")
            except UnicodeDecodeError:
                ident = example_id(name, line_number, payload_bytes.hex())
                yield Example(ident, name, line_number, file_source or NO_SOURCE, ERROR, "not_utf8")
                continue
            try:
                record = json.loads(payload)
            except json.JSONDecodeError:
                ident = example_id(name, line_number, payload)
                yield Example(
                    ident, name, line_number, file_source or NO_SOURCE, ERROR, "invalid_json"
                )
                continue
            source = _row_source(record, file_source, source_column)
            yield parse_record(record, name, line_number, source, payload)


def iter_parquet(path: Path, file_source: str | None, source_column: str) -> Iterator[Example]:
    name = display_name(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a broken file
        raise DataError(
            f"{path}: not a readable Parquet file ({type(error).__name__}); "
            "rewrite it with pandas/pyarrow or convert it to JSONL."
        ) from error
    row = 0
    batches = parquet.iter_batches(batch_size=4096)
    while True:
        try:  # the footer read fine; a page may still be corrupt
            batch = next(batches, None)
        except Exception as error:
            raise DataError(
                f"{path}: rows after {row} cannot be read ({type(error).__name__}: {error}); the "
                "file is damaged: rewrite it from its source, or convert the readable part to "
                "JSONL."
            ) from error
        if batch is None:
            break
        for record in batch.to_pylist():
            row += 1
            payload = json.dumps(record, sort_keys=True, default=str)
            source = _row_source(record, file_source, source_column)
            yield parse_record(record, name, row, source, payload)


def load_file(
    path: str | Path, source: str | None = None, source_column: str = "source"
) -> list[Example]:
    """All rows of one file, each with a status. A missing or unusable file is a DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist; fix data.files in the config.")
    if path.suffix == ".jsonl":
        examples = list(iter_jsonl(path, source, source_column))
    elif path.suffix == ".parquet":
        examples = list(iter_parquet(path, source, source_column))
    else:
        raise DataError(f"{path}: unsupported extension '{path.suffix}'; use .jsonl or .parquet.")
    if not any(example.status == OK for example in examples):
        counts = Counter(example.status for example in examples)
        reasons = Counter(example.reason for example in examples if example.reason)
        raise DataError(
            f"{path}: no usable example ({len(examples)} rows: {dict(counts)}; reasons: "
            f"{dict(reasons.most_common())}); each row needs `messages` [{{role, content}}], "
            "`conversations` [{from, value}] or `text` (reason codes: probes/padding/data.py)."
        )
    return examples


def load_examples(files: Iterable[dict[str, Any]]) -> list[Example]:
    """Load every configured file (entries of config `data.files`), in order."""
    examples: list[Example] = []
    seen: dict[Path, int] = {}
    for index, entry in enumerate(files):
        resolved = Path(entry["path"]).resolve()
        if resolved in seen:
            raise DataError(
                f"data.files[{index}].path: '{entry['path']}' is the file of "
                f"data.files[{seen[resolved]}] again; list each file once."
            )
        seen[resolved] = index
        examples.extend(
            load_file(entry["path"], entry.get("source"), entry.get("source_column", "source"))
        )
    return examples


def status_counts(examples: Iterable[Example]) -> dict[str, int]:
    counts = Counter(example.status for example in examples)
    return {status: counts.get(status, 0) for status in STATUSES}


def error_locations(examples: Iterable[Example]) -> list[dict[str, Any]]:
    """File, row and reason code of every EMPTY/ERROR row: safe to log, no text."""
    return [
        {"file": e.file, "row": e.row, "status": e.status, "reason": e.reason}
        for e in examples
        if e.status in (EMPTY, ERROR)
    ]
