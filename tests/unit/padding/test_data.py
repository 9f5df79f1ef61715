import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import CANARY, chat_rows, write_jsonl
from probes.padding.data import (
    EMPTY,
    ERROR,
    OK,
    DataError,
    error_locations,
    load_examples,
    load_file,
    status_counts,
    turn_reason,
)


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


# One malformed turn shape per case, OpenAI `messages` and ShareGPT `conversations` alike; the
# good turns carry the canary so a test can see that no reason or location ever holds data text.
MALFORMED_TURNS = [
    ("messages", [{"role": "user", "content": CANARY}, {"role": "assistant"}], "content_missing"),
    (
        "messages",
        [{"role": "user", "content": CANARY}, {"role": "assistant", "content": None}],
        "content_missing",
    ),
    (
        "messages",
        [{"role": "user", "content": [{"type": "text", "text": CANARY}]}],
        "content_not_a_string",
    ),
    ("messages", [{"role": "user", "content": CANARY}, {"content": CANARY}], "role_missing"),
    ("messages", [{"role": "wizard", "content": CANARY}], "unknown_role"),
    ("messages", CANARY, "turns_not_a_list"),
    ("messages", [CANARY], "turn_not_an_object"),
    ("conversations", [{"from": "human", "value": CANARY}, {"from": "gpt"}], "content_missing"),
    ("conversations", [{"from": "human", "value": 7}], "content_not_a_string"),
    ("conversations", [{"value": CANARY}], "role_missing"),
    ("conversations", {"from": "human", "value": CANARY}, "turns_not_a_list"),
    ("conversations", [["human", CANARY]], "turn_not_an_object"),
]
CASE_IDS = [f"{key}-{reason}-{index}" for index, (key, _, reason) in enumerate(MALFORMED_TURNS)]


def assert_no_data_text(examples):
    for location in error_locations(examples):
        assert CANARY not in json.dumps(location)


@pytest.mark.parametrize(("key", "turns", "reason"), MALFORMED_TURNS, ids=CASE_IDS)
def test_malformed_turn_is_an_error_with_its_reason_in_parquet(tmp_path, key, turns, reason):
    # Parquet columns are nullable: the good row uses `text`, the bad one the turns column.
    path = tmp_path / "turns.parquet"
    rows = [{key: None, "text": "hello"}, {key: turns, "text": None}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    good, bad = load_file(path)
    assert good.status == OK
    assert (bad.row, bad.status, bad.reason) == (2, ERROR, reason)
    assert bad.messages is None and bad.text is None
    assert_no_data_text([good, bad])


def test_malformed_turns_are_errors_with_their_reasons_in_jsonl(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [good] + [{key: turns} for key, turns, _ in MALFORMED_TURNS]
    examples = load_file(write_jsonl(tmp_path / "turns.jsonl", rows))
    assert [(e.row, e.status) for e in examples[:1]] == [(1, OK)]
    assert [(e.status, e.reason) for e in examples[1:]] == [
        (ERROR, reason) for _, _, reason in MALFORMED_TURNS
    ]
    assert status_counts(examples)["ERROR"] == len(MALFORMED_TURNS)
    assert_no_data_text(examples)


def test_turn_reason_order_and_well_formed_turns():
    assert turn_reason({"role": "user", "content": ""}, "role", "content") == ""
    assert turn_reason({"from": "gpt", "value": "x"}, "from", "value") == ""
    # several faults: the first in the documented order wins
    assert turn_reason({}, "role", "content") == "role_missing"
    assert turn_reason({"role": 3}, "role", "content") == "unknown_role"
    # a ShareGPT turn spelled the OpenAI way has no `from`
    assert turn_reason({"role": "user", "content": "x"}, "from", "value") == "role_missing"


def test_file_whose_turns_all_lack_content_is_refused_without_data_text(tmp_path):
    rows = [{"messages": [{"role": "user", "content": CANARY}, {"role": "assistant"}]}] * 3
    with pytest.raises(DataError, match="no usable example") as caught:
        load_file(write_jsonl(tmp_path / "no_content.jsonl", rows))
    assert CANARY not in str(caught.value) and "'ERROR': 3" in str(caught.value)


def test_two_files_with_one_basename_stay_apart_and_ids_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_jsonl(tmp_path / folder / "train.jsonl", chat_rows(20))
    absolute = str(tmp_path / "b" / "train.jsonl")  # under the working directory: made relative
    examples = load_examples([{"path": "a/train.jsonl"}, {"path": absolute}])
    assert len(examples) == 40 and len({e.example_id for e in examples}) == 40
    assert {e.file for e in examples} == {"a/train.jsonl", "b/train.jsonl"}
    with pytest.raises(DataError, match=r"data.files\[1\].path: 'a/./train.jsonl' is the file of"):
        load_examples([{"path": "a/train.jsonl"}, {"path": "a/./train.jsonl"}])


def test_utf8_bom_does_not_make_row_one_invalid(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hello"}).encode() + b"\n")
    assert [e.status for e in load_file(path)] == [OK]


def test_corrupt_parquet_pages_are_named_not_a_raw_oserror(tmp_path):
    path = tmp_path / "broken.parquet"
    rows = [{"text": f"hello {i} " + "pizza " * (i % 50)} for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy")
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[64 : len(data) - footer - 64] = b"\xff" * (len(data) - footer - 128)  # footer intact
    path.write_bytes(bytes(data))
    pq.ParquetFile(path)  # the footer still reads
    with pytest.raises(DataError, match=r"broken\.parquet: rows after 0 cannot be read"):
        load_file(path)


def test_file_without_usable_rows_names_the_reason_codes(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"foo": 1}, {"foo": 2}])
    with pytest.raises(DataError, match="no_messages_conversations_or_text': 2, 'no_content': 1"):
        load_file(bad)
