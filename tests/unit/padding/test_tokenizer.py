"""The model's tokenizer loaded and set up as training uses it."""

from __future__ import annotations

import pytest

from probes.padding.tokenizer import TokenizeError, load_tokenizer, rust_backend


def test_rust_backend_never_truncates_and_leaves_the_tokenizer_alone(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert rust_backend(tokenizer) is tokenizer.backend_tokenizer  # already as training uses it
    tokenizer.backend_tokenizer.enable_truncation(3)
    backend = rust_backend(tokenizer)
    assert backend is not tokenizer.backend_tokenizer
    assert backend.truncation is None and tokenizer.backend_tokenizer.truncation is not None
    assert len(backend.encode("hello how are you today", add_special_tokens=False)) == 5


def test_model_directory_without_tokenizer_json_is_named(tiny_model_dir, tmp_path):
    import shutil

    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(TokenizeError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
