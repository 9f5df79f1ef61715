import json

import pandas as pd
import pytest

from conftest import chat_rows, write_jsonl
from probes.data import EMPTY, ERROR, OK, DataError, load_examples, load_file, status_counts


def test_jsonl_rows_each_get_a_status_with_line_numbers(tmp_path):
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "source": "a"}),
        "{not json",
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
        json.dumps(
            {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
        ),
        json.dumps({"text": "plain"}),
        json.dumps({"text": "   "}),
        json.dumps([1, 2]),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    examples = load_file(path)
    by_row = {example.row: example for example in examples}
    assert [by_row[row].status for row in range(1, 10)] == [
        OK,
        ERROR,
        EMPTY,
        ERROR,
        OK,
        OK,
        EMPTY,
        ERROR,
        ERROR,
    ]
    assert by_row[2].reason == "invalid_json"
    assert by_row[4].reason == "unknown_role"
    assert by_row[9].reason == "not_utf8"
    assert by_row[1].source == "a" and by_row[5].source == "none"
    assert by_row[5].messages == (("user", "x"), ("assistant", "y"))
    assert status_counts(examples) == {"OK": 3, "EMPTY": 2, "ERROR": 4, "TRUNCATED": 0}
    # reason codes are codes, never text from the data
    assert all("caf" not in example.reason for example in examples)


def test_parquet_rows_and_per_file_source(tmp_path):
    path = tmp_path / "chat.parquet"
    pd.DataFrame(chat_rows(6)).to_parquet(path)
    examples = load_examples([{"path": str(path), "source": "forum"}])
    assert len(examples) == 6 and {e.source for e in examples} == {"forum"}
    assert [e.row for e in examples] == [1, 2, 3, 4, 5, 6]
    assert len({e.example_id for e in examples}) == 6


def test_missing_file_and_file_without_usable_rows_are_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_file(tmp_path / "absent.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"foo": 1}])
    with pytest.raises(DataError, match="no usable example"):
        load_file(bad)
