"""MFU's FLOP count for LoRA, checked against torch's own FlopCounterMode on tiny random-init
models (the counter is the independent computation: it counts the matmuls that really ran)."""

import pytest
import torch

from conftest import tiny_gemma
from probes.profile import flops as fl
from probes.step import batches as bt
from probes.step import reference_harness

VOCAB = 2048  # a head as large as the decoder, like a 262k vocabulary on a 270M model
LENGTH, ROWS, LOSS_SHARE = 48, 2, 0.4


@pytest.fixture(autouse=True)
def reference_options():
    yield
    reference_harness.configure({})  # no later test inherits these options


def tiny_gemma_sdpa(vocab: int = VOCAB):
    model = tiny_gemma(vocab)  # conftest's 4-layer Gemma 3, random init
    model.config._attn_implementation = "sdpa"
    return model


def lora_model(options=None):
    model = tiny_gemma_sdpa()
    active = fl.model_active_parameters(model)["active_params"]
    reference_harness.configure({"lora_r": 4, **(options or {})})
    model = reference_harness.apply_adapters(
        model, reference_harness.discover_target_modules(model)
    )
    model.train()
    return model, active


def batch():
    generator = torch.Generator().manual_seed(0)
    return bt.uniform_batch(ROWS, LENGTH, LOSS_SHARE, VOCAB, generator)


def counted_linear(model, compute_loss, data) -> float:
    counts = fl.count_flops_by_op(lambda: compute_loss(model, data).backward())
    return float(sum(v for op, v in counts.items() if op in fl.LINEAR_OPS))


def test_step_parameters_split_frozen_base_adapters_and_head():
    model, _ = lora_model()
    params = fl.step_parameters(model)
    # independent count: r x (in + out) per adapted nn.Linear, from the modules themselves
    adapted = [m for n, m in model.named_modules() if n.endswith(("_proj",)) and hasattr(m, "r")]
    lora = sum(4 * (m.in_features + m.out_features) for m in adapted)
    assert params.trainable == lora == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the tied head: vocab x hidden, counted once and not as a frozen decoder weight
    assert params.head == VOCAB * 64 and params.head_trainable is False
    decoder = sum(p.numel() for p in model.get_base_model().model.layers.parameters())
    frozen_decoder = decoder - lora
    norm = 64  # the final norm is the only frozen weight outside the layers and the embedding
    assert params.frozen == frozen_decoder + norm


def test_lora_step_flops_by_hand():
    params = fl.StepParameters(frozen=1000, trainable=10, head=500, head_trainable=False)
    flops = fl.lora_step_flops(params, n_tokens=8, head_tokens=3, attention_flops=7.0)
    assert flops.frozen == 4 * 1000 * 8
    assert flops.trainable == 6 * 10 * 8
    assert flops.head == 4 * 500 * 3
    assert flops.total == 32000 + 480 + 6000 + 7
    trained_head = fl.StepParameters(1000, 10, 500, head_trainable=True)
    assert fl.lora_step_flops(trained_head, 8, 3, 0.0).head == 6 * 500 * 3


def test_analytic_count_matches_the_flop_counter_and_the_old_6n_does_not():
    model, active = lora_model()
    data = batch()
    counted = counted_linear(model, reference_harness.compute_loss, data)
    flops = fl.lora_step_flops(
        fl.step_parameters(model),
        n_tokens=ROWS * LENGTH,
        head_tokens=bt.loss_position_count(data["labels"]),
        attention_flops=0.0,
    )
    assert flops.linear / counted == pytest.approx(1.0, abs=0.15)
    old = fl.training_step_flops(active, ROWS * LENGTH, 0.0)  # 6 x N x every token
    assert abs(old / counted - 1.0) > 0.15
    # the reference harness runs its head on the loss positions and says so
    assert fl.head_positions_of(reference_harness) == "loss"


def full_logits_loss(model, data):
    logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), data["labels"][:, 1:].flatten(), ignore_index=-100
    )


def test_a_harness_with_the_stock_loss_pays_the_head_on_every_position():
    model, _ = lora_model()
    data = batch()
    counted = counted_linear(model, full_logits_loss, data)
    params = fl.step_parameters(model)
    tokens = ROWS * LENGTH
    everywhere = fl.lora_step_flops(params, tokens, tokens, 0.0)
    only_loss = fl.lora_step_flops(params, tokens, bt.loss_position_count(data["labels"]), 0.0)
    assert everywhere.linear / counted == pytest.approx(1.0, abs=0.15)
    assert abs(only_loss.linear / counted - 1.0) > 0.15
    assert fl.head_positions_of(object()) == "all"  # no LM_HEAD_POSITIONS: the stock loss


def test_flop_control_passes_within_tolerance_and_fails_outside():
    flops = fl.StepFlops(
        frozen=400.0, trainable=60.0, head=40.0, attention=9.0, n_tokens=1, head_tokens=1
    )
    assert fl.flop_counter_control(flops, {"aten.mm": 520, "aten.bmm": 99})["passed"] is True
    failed = fl.flop_counter_control(flops, {"aten.mm": 800})
    assert failed["passed"] is False
    assert failed["observed"]["analytic_over_counted"] == pytest.approx(500 / 800)
    assert failed["mfu_unverified_reason"].startswith("the analytic FLOP count is 0.625 x")
    blind = fl.flop_counter_control(flops, {})  # nothing counted: the counter could not see it
    assert blind["passed"] is False and blind["gates_stage"] is False
    assert "cannot see it" in blind["mfu_unverified_reason"]
    assert fl.flop_counter_control(flops, {"aten.mm": 520})["mfu_unverified_reason"] is None


def test_gradient_checkpointing_recompute_is_counted_by_the_control_not_by_mfu():
    model, _ = lora_model({"gradient_checkpointing": True})
    data = batch()
    counts = fl.count_flops_by_op(lambda: reference_harness.compute_loss(model, data).backward())
    flops = fl.lora_step_flops(
        fl.step_parameters(model), ROWS * LENGTH, bt.loss_position_count(data["labels"]), 0.0
    )
    assert fl.flop_counter_control(flops, counts, recomputed_forward=True)["passed"] is True
    assert fl.flop_counter_control(flops, counts, recomputed_forward=False)["passed"] is False


def test_invalid_head_positions_are_refused():
    class Harness:
        LM_HEAD_POSITIONS = "some"

    with pytest.raises(ValueError, match="LM_HEAD_POSITIONS"):
        fl.head_positions_of(Harness)
