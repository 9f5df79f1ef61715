"""Scaling per layer type on a heterogeneous config (Gemma 4: full-attention layers with their
own head dim and KV heads, K = V; MoE experts beside a dense MLP)."""

from __future__ import annotations

import dataclasses

import torch

from probes.mask.trace import config_from_dict
from probes.memory.layers import build_scaled_step, predict_scaled, reduced_config
from probes.memory.predict import Shape, functions_of, predict
from probes.step import reference_harness

SLIDING, FULL = "sliding_attention", "full_attention"
TINY_GEMMA4_MOE = {
    "model_type": "gemma4_text",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "enable_moe_block": True,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "hidden_size_per_layer_input": 0,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    "layer_types": [SLIDING, FULL, SLIDING, FULL],
}


def _attention_shapes(config) -> list[tuple[int, bool]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [
        (layer.self_attn.head_dim, layer.self_attn.v_proj is None) for layer in model.model.layers
    ]


def test_reduced_models_give_each_layer_its_types_shapes():
    # per_layer_config is keyed by layer index: a reduced model that kept the full model's keys
    # gave its full-attention layer the sliding layers' head dim (the 26B-A4B's full layers lost
    # a quarter of their attention parameters and their K = V)
    config = config_from_dict(dict(TINY_GEMMA4_MOE))
    assert _attention_shapes(config) == [(16, False), (32, True)] * 2
    assert _attention_shapes(reduced_config(config, [FULL, SLIDING, FULL])) == [
        (32, True),
        (16, False),
        (32, True),
    ]


def test_scaling_matches_the_whole_model_or_traces_it(monkeypatch):
    from probes.memory import layers
    from probes.memory.predict import build_fake_step

    made: dict[int, object] = {}  # one trace per fake model: the test stays a few seconds

    def once(step, shape):
        if id(step) not in made:
            made[id(step)] = predict(step, shape)
        return dataclasses.replace(made[id(step)], assumptions=list(made[id(step)].assumptions))

    monkeypatch.setattr(layers, "predict", once)
    reference_harness.configure({"gradient_checkpointing": True})
    try:
        functions = functions_of(reference_harness)
        config = config_from_dict(dict(TINY_GEMMA4_MOE))
        scaled = build_scaled_step(config, functions, "bfloat16", 1, 512)
        shape = Shape("a", 1, 32)
        whole = once(scaled.whole, shape)
        found = predict_scaled(scaled, shape)
        assert found.by_category == whole.by_category
        assert "scaled per layer type" in found.assumptions[0]
        # a check trace the line cannot meet (one layer of each type, not two): the whole model
        # is traced, and the figure says so
        other = reduced_config(config, [SLIDING, FULL])
        wrong = dataclasses.replace(
            scaled, check=build_fake_step(other, functions, "bfloat16", 1, 512)
        )
        fallback = predict_scaled(wrong, shape)
        assert fallback.by_category == whole.by_category
        assert fallback.assumptions[0].startswith("the whole model traced")
    finally:
        reference_harness.configure({})
