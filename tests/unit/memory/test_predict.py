"""The predictor: a peak known by construction, real CPU steps, data-dependent ops, bad inputs."""

from __future__ import annotations

import pytest
import torch

from probes.mask.trace import config_from_dict
from probes.memory import control
from probes.memory.predict import (
    PredictError,
    Shape,
    build_fake_step,
    functions_of,
    predict,
)
from probes.memory.real import measure_step_peak
from probes.memory.tracker import OPTIMIZER
from probes.step import reference_harness

GEMMA = control.TINY_GEMMA3


@pytest.fixture(scope="module")
def functions():
    reference_harness.configure({})
    return functions_of(reference_harness)


@pytest.fixture(scope="module")
def tiny_step(functions):
    return build_fake_step(config_from_dict(dict(GEMMA)), functions, "float32")


def test_known_model_is_predicted_to_the_byte():
    hand = control.known_peak()
    predicted = control.predict_known()
    assert predicted["by_category"] == hand
    assert predicted["peak_bytes"] == sum(hand.values())
    assert predicted["phase"] == "backward" and predicted["op"] == "threshold_backward.default"


def test_real_step_of_the_known_model_matches_and_the_check_can_fail():
    model, optimizer, batch = control._known_step(fake=False)
    real = measure_step_peak(model, optimizer, control.known_loss, batch)
    predicted = control.predict_known()
    assert real["peak_bytes"] == predicted["peak_bytes"]  # another instrument, same bytes
    without_optimizer = predicted["peak_bytes"] - predicted["by_category"][OPTIMIZER]
    assert not control.within(without_optimizer, real["peak_bytes"], 0.10)
    checks = control.real_step_control(0.10)
    assert [c["passed"] for c in checks] == [True, True]


def test_harness_step_within_ten_percent_of_the_real_cpu_step(functions, tiny_step):
    shape = control.HARNESS_SHAPE
    predicted = predict(tiny_step, shape)
    real = control.real_harness_peak(functions, shape)
    assert abs(predicted.peak_bytes / real - 1) <= 0.10
    split = predicted.by_category
    assert sum(split.values()) == predicted.peak_bytes
    assert split["parameters"] > 0 and split["optimizer_state"] > 0
    # LoRA: the optimizer holds two float32 states per trainable (adapter) parameter only
    trainable = sum(p.numel() for p in tiny_step.model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in tiny_step.model.parameters() if not p.requires_grad)
    assert frozen > 0
    assert split["optimizer_state"] == 2 * 4 * trainable + 4 * len(
        [p for p in tiny_step.model.parameters() if p.requires_grad]
    )


def test_peak_grows_with_rows_and_loss_positions(tiny_step):
    one = predict(tiny_step, Shape("a", 1, 64)).peak_bytes
    two = predict(tiny_step, Shape("b", 2, 64)).peak_bytes
    few = predict(tiny_step, Shape("c", 2, 64, loss_tokens=4))
    assert one < two and few.peak_bytes <= two
    assert any("4 loss positions" in a for a in few.assumptions)


def test_bad_dtype_names_the_key(functions):
    with pytest.raises(PredictError, match="mask.dtype"):
        build_fake_step(config_from_dict(dict(GEMMA)), functions, "int8")


def test_data_dependent_op_is_unknown_with_its_reason(tiny_step):
    def loss_with_item(model, batch):
        ids = batch["input_ids"]
        if ids.sum().item() > 0:  # a value the fake tensors do not have
            return ids.float().sum()
        return model.get_base_model().get_decoder()(input_ids=ids)[0].sum()

    from dataclasses import replace

    from probes.memory.predict import FakeStep

    step = FakeStep(**{**tiny_step.__dict__, "harness": replace(tiny_step.harness,
                       compute_loss=loss_with_item)})  # fmt: skip
    with pytest.raises(PredictError, match="data-dependent"):
        predict(step, Shape("x", 1, 16))
    torch.manual_seed(0)


TINY_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 64,
    "head_dim": 8,
}


def test_moe_config_runs_with_its_assumption_stated(functions):
    step = build_fake_step(config_from_dict(dict(TINY_MOE)), functions, "bfloat16")
    found = predict(step, Shape("moe", 2, 16))
    assert found.peak_bytes > 0
    assert any("MoE experts" in a and "routing" in a for a in found.assumptions)
    # float32 has no fake kernel for the grouped matmul: unknown, with the op's own words
    step32 = build_fake_step(config_from_dict(dict(TINY_MOE)), functions, "float32")
    with pytest.raises(PredictError, match="cannot run on fake tensors"):
        predict(step32, Shape("moe", 2, 16))


def test_real_vs_predicted_passes_and_fails(functions):
    from probes.memory.check import real_vs_predicted

    shape = control.HARNESS_SHAPE
    real = control.real_harness_peak(functions, shape)
    config = config_from_dict(dict(GEMMA))
    passed = real_vs_predicted(config, functions, "float32", {shape: real})
    assert passed["passed"] and passed["rows"][0]["passed"]
    wrong = real_vs_predicted(config, functions, "float32", {shape: real * 2})
    assert not wrong["passed"] and "2 x 128" in wrong["message"]


def test_a_kernels_own_temporary_is_counted():
    """logsumexp forms exp(x - max) at the input's size inside its kernel: no op returns it,
    the profiler's allocator events see it, and so must the prediction."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from probes.memory.real import cpu_allocator_peak
    from probes.memory.tracker import StepTracker

    real_x = torch.randn(256, 1000)
    real = cpu_allocator_peak(lambda: torch.logsumexp(real_x, dim=-1))
    with FakeTensorMode():
        x = torch.empty(256, 1000)
        tracker = StepTracker()
        with tracker:
            tracker.phase("forward")
            torch.logsumexp(x, dim=-1)
    assert tracker.peak().total == real
