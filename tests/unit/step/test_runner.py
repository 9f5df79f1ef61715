"""probes.step.runner: the device a GPU stage runs on, and the text config of a model."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from probes.step.runner import ProfileError, model_text_config, resolve_device


def test_cpu_fallback_only_where_allowed():
    assert resolve_device("cpu", allow_cpu=True).type == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device("auto", allow_cpu=True).type == "cpu"
        with pytest.raises(ProfileError, match="profile.device is 'cuda'"):
            resolve_device("cuda", allow_cpu=True)


def test_text_config_is_the_models_own():
    config = LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=3,
    )  # fmt: skip
    text = model_text_config(LlamaForCausalLM(config))
    assert text["vocab_size"] == 96 and text["pad_token_id"] == 3
