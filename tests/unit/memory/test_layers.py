"""Trace a few decoder layers and scale per layer type: equal to the whole-model trace."""

from __future__ import annotations

from probes.mask.trace import config_from_dict
from probes.memory import control
from probes.memory.layers import (
    build_scaled_step,
    layer_types,
    predict_scaled,
    reduced_types,
)
from probes.memory.predict import PACKED, Shape, build_fake_step, functions_of, predict
from probes.step import reference_harness

SLIDING, FULL = "sliding_attention", "full_attention"


def test_reduced_models_keep_the_last_layer_type_last():
    full = [SLIDING, SLIDING, FULL, SLIDING]
    assert reduced_types(full, {SLIDING: 1, FULL: 2}) == [FULL, FULL, SLIDING]
    assert (
        layer_types(config_from_dict({"model_type": "llama", "num_hidden_layers": 3}))
        == ["decoder_layer"] * 3
    )


def test_scaling_is_exact_on_a_tiny_model():
    # checkpointing on (the peak in the last layer's recompute) and a packed row; off was
    # checked the same way when this was written (the suite is over its time budget)
    shape = Shape("packed", 1, 128, PACKED, 50)
    reference_harness.configure({"gradient_checkpointing": True})
    try:
        functions = functions_of(reference_harness)
        types = [SLIDING, FULL, SLIDING, SLIDING]  # 3 sliding : 1 full, a sliding layer last
        config = dict(control.TINY_GEMMA3, num_hidden_layers=len(types), layer_types=types)
        whole = build_fake_step(config_from_dict(dict(config)), functions, "bfloat16", 2, 512)
        scaled = build_scaled_step(config_from_dict(dict(config)), functions, "bfloat16", 2, 512)
        for shape in (Shape("a", 2, 64), Shape("b", 1, 128, PACKED, 50)):
            expected, found = predict(whole, shape), predict_scaled(scaled, shape)
            assert found.by_category == expected.by_category
            assert found.peak_bytes == expected.peak_bytes
            assert (
                "scaled per layer type to the model's 4 (3 sliding_attention"
                in (found.assumptions[0])
            )
    finally:
        reference_harness.configure({})
