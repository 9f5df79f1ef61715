"""Model FLOPs for MFU, counted the way a LoRA (frozen-base) training step really runs.

MFU_CONVENTION below is the text the report prints. In short, per training step:

- frozen base matmul weights: 4 FLOPs per parameter per token (forward 2 + input gradient 2; a
  frozen weight gets no weight gradient). The common "6 x N x tokens" assumes every weight trains
  and reads about 1.5x too high for LoRA;
- trainable weights (the adapters, or anything the harness unfreezes): 6 (forward 2 + input
  gradient 2 + weight gradient 2);
- the LM head: 4 per parameter (6 if it trains) per position it runs on. A harness that declares
  ``LM_HEAD_POSITIONS = "loss"`` (the reference harness: its chunked loss runs the head on the
  loss positions only) pays it on those; any other harness is taken to compute the logits of
  every position, as the stock causal-LM loss does;
- the input embedding is a lookup (0 FLOPs); a head tied to it is counted once, as the head;
- MoE: only experts_per_token / num_experts of the routed expert weights run per token;
- attention: QK^T and PV over the query-key pairs the causal / sliding-window mask keeps,
  forward + backward = 3 x forward (the work an ideal kernel does).

Not counted: norms, elementwise ops, softmax, the optimizer, and the forward recomputed under
gradient checkpointing (these are model FLOPs, not hardware FLOPs). Known approximation: the
first layer's q/k/v projections take the embedding output, which needs no gradient, so their
input gradient is never computed (under 1% of a real model's count).

The count is checked against torch.utils.flop_counter.FlopCounterMode over one real step of the
harness (`flop_counter_control`): the counter's matmul FLOPs (aten.mm / addmm: every linear layer,
adapter and head) must match the analytic linear count within the tolerance. Attention is shown
beside it but not gated: the counter counts the full T x T square (and recomputed scores in the
backward), and has no formula for CPU's flash kernel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# bf16 dense tensor-core peaks (TFLOP/s, no sparsity) by device-name substring; first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("A6000", 155.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
)

TOPK_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "experts_per_token",
    "moe_topk",
    "top_k_experts",
    "num_selected_experts",
)
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# routed expert weights: "...experts.<i>..." or fused "...experts.gate_up_proj"; shared experts
# run for every token and are counted in full
ROUTED_EXPERT = re.compile(r"(^|\.)experts(\.|$)")
SHARED_EXPERT = re.compile(r"shared_expert")
NOT_TEXT = re.compile(r"(vision_tower|vision_model|multi_modal_projector|audio_tower|embed_vision)")


def _first(config: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        value = config.get(key)
        if value:
            return value
    return None


def moe_active_fraction(text_config: Mapping[str, Any]) -> float | None:
    """experts_per_token / num_experts, or None for a dense model."""
    top_k = _first(text_config, TOPK_KEYS)
    n_experts = _first(text_config, NUM_EXPERTS_KEYS)
    if not top_k or not n_experts:
        return None
    return float(top_k) / float(n_experts)


def active_parameter_count(
    named_sizes: Iterable[tuple[str, int]],
    text_config: Mapping[str, Any],
    input_embedding_names: Sequence[str] = (),
    head_names: Sequence[str] = (),
    tied_head_size: int = 0,
) -> dict[str, Any]:
    """Parameters one token's forward touches. `named_sizes` are (name, numel) of the base model.

    `input_embedding_names` are dropped (a lookup, no FLOPs); a head tied to the embedding is
    not in the list of parameters, so its size comes back as `tied_head_size`.
    """
    fraction = moe_active_fraction(text_config)
    total = embedding = routed = shared_or_dense = other_modality = 0
    for name, size in named_sizes:
        total += size
        if NOT_TEXT.search(name):
            other_modality += size
        elif name in input_embedding_names:
            embedding += size
        elif fraction is not None and ROUTED_EXPERT.search(name) and not SHARED_EXPERT.search(name):
            routed += size
        else:
            shared_or_dense += size
    active = shared_or_dense + tied_head_size + (routed * fraction if fraction is not None else 0)
    return {
        "total_params": int(total),
        "active_params": int(round(active)),
        "embedding_params": int(embedding),
        "routed_expert_params": int(routed),
        "moe_active_fraction": fraction,
        "non_text_params": int(other_modality),
        "tied_head_params": int(tied_head_size),
        "head_names": list(head_names),
    }


def model_active_parameters(model: Any) -> dict[str, Any]:
    """active_parameter_count for a loaded transformers model (call before adding adapters)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    names_by_id: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        names_by_id.setdefault(id(param), name)
    embedding_names = [n for pid, n in names_by_id.items() if pid in embed_ids]
    tied = 0
    head_names: list[str] = []
    if head is not None:
        for param in head.parameters():
            if id(param) in embed_ids:
                tied += param.numel()  # tied: counted as the head, not as an embedding
            head_names.append(names_by_id.get(id(param), "tied_to_embedding"))
    sizes = [(names_by_id[id(p)], p.numel()) for p in model.parameters()]
    return active_parameter_count(sizes, text_config.to_dict(), embedding_names, head_names, tied)


def layer_windows(text_config: Mapping[str, Any]) -> list[int | None]:
    """Per decoder layer: the sliding window in tokens, or None for full (causal) attention."""
    n_layers = int(text_config.get("num_hidden_layers") or 0)
    window = text_config.get("sliding_window")
    types = text_config.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [None] * n_layers


def attended_pairs(length: int, window: int | None) -> int:
    """Causal query-key pairs in one sequence: sum over positions of the keys each one sees."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    # the first `window` positions see 1..window keys, the rest see `window` each
    return window * (window + 1) // 2 + (length - window) * window


def attention_training_flops(text_config: Mapping[str, Any], seq_lengths: Sequence[int]) -> float:
    """QK^T and PV matmuls, forward + backward (3x forward), over the pairs the mask keeps.

    Counts attended pairs only (causal, sliding window), i.e. the work an ideal kernel does; the
    common 12*L*H*d*T^2 convention counts the full square and reads about twice as high.
    """
    n_heads = int(text_config.get("num_attention_heads") or 0)
    hidden = int(text_config.get("hidden_size") or 0)
    head_dim = int(text_config.get("head_dim") or (hidden // max(n_heads, 1)))
    total = 0.0
    for window in layer_windows(text_config):
        pairs = sum(attended_pairs(int(length), window) for length in seq_lengths)
        total += 2 * 2 * n_heads * head_dim * pairs  # two matmuls, 2 FLOPs per multiply-add
    return 3.0 * total


def training_step_flops(
    active_params: int, n_tokens: int, attention_flops: float, per_param: int = 6
) -> float:
    """per_param x N x tokens + attention: the dense full fine-tune convention (6 = forward 2 +
    backward 4, every weight trains, the head on every token). Too high for LoRA; kept for
    comparison only (MFU uses lora_step_flops)."""
    return float(per_param) * active_params * n_tokens + attention_flops


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak by device name, or None when unknown (CPUs, unlisted cards)."""
    upper = device_name.upper()
    for key, value in PEAK_BF16_TFLOPS:
        if key in upper:
            return value
    return None


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float:
    if peak_tflops is None or not math.isfinite(seconds) or seconds <= 0:
        return float("nan")
    return flops / seconds / (peak_tflops * 1e12)


# ---------------------------------------------------------------------------------------------
# The LoRA / frozen-base convention (the one MFU uses) and its cross-check by counting
# ---------------------------------------------------------------------------------------------

# Attribute a harness module may set: "loss" when its loss runs the LM head on loss positions
# only (the reference harness), "all" (the default) when it computes every position's logits.
HEAD_POSITIONS_ATTRIBUTE = "LM_HEAD_POSITIONS"
HEAD_POSITIONS = ("loss", "all")
FLOP_TOLERANCE = 0.15  # analytic / counted matmul FLOPs must lie within 1 +- this
# FlopCounterMode ops that carry the linear layers (nn.Linear, adapters, the chunked head)
LINEAR_OPS = ("aten.mm", "aten.addmm", "aten._scaled_mm")

MFU_CONVENTION = (
    "MFU = model FLOPs per step / measured step time / peak. Model FLOPs (LoRA convention): "
    "frozen base weights 4 per parameter per token (forward 2 + input gradient 2, no weight "
    "gradient); trainable weights (adapters) 6; the LM head 4 per parameter (6 if it trains) "
    "on the positions it runs on (loss positions for a harness that declares "
    "LM_HEAD_POSITIONS = 'loss', like the reference harness; every position otherwise); "
    "embedding lookups 0; routed MoE experts at experts_per_token / num_experts; attention "
    "QK^T and PV over the pairs the causal / sliding-window mask keeps, x3 for forward + "
    "backward. Not counted: norms, elementwise, optimizer, gradient-checkpointing recompute. "
    "Peak: the device's dense bf16 tensor-core peak without sparsity (H100/H200 989 TFLOP/s) "
    "or profile.peak_tflops. Cross-checked against torch.utils.flop_counter.FlopCounterMode "
    "on one real step (control analytic_flops_match_flop_counter, linear layers within "
    "+-15%)."
)


@dataclass(frozen=True)
class StepParameters:
    """Parameters one token's matmuls touch, split by how the backward treats them."""

    frozen: int  # base weights without gradient (MoE-weighted; no embedding, no head)
    trainable: int  # weights with gradient (adapters, unfrozen layers; MoE-weighted)
    head: int  # the LM head (tied or not)
    head_trainable: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one training step under MFU_CONVENTION, term by term."""

    frozen: float
    trainable: float
    head: float
    attention: float
    n_tokens: int
    head_tokens: int

    @property
    def linear(self) -> float:
        """Every weight matmul: what FlopCounterMode sees as aten.mm / addmm."""
        return self.frozen + self.trainable + self.head

    @property
    def total(self) -> float:
        return self.linear + self.attention

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "linear": self.linear, "total": self.total}


def _split_parameters(
    named: Iterable[tuple[str, int, bool]],
    text_config: Mapping[str, Any],
    embedding_names: Sequence[str],
) -> tuple[int, int]:
    """(frozen, trainable) active counts of (name, numel, requires_grad) rows."""
    rows = list(named)
    frozen = [(n, s) for n, s, grad in rows if not grad]
    trainable = [(n, s) for n, s, grad in rows if grad]
    count = active_parameter_count
    return (
        count(frozen, text_config, embedding_names)["active_params"],
        count(trainable, text_config, embedding_names)["active_params"],
    )


def step_parameters(model: Any) -> StepParameters:
    """StepParameters of a model as it trains (call after the harness added its adapters)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed = base.get_input_embeddings()
    head = base.get_output_embeddings()
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    head_params = list(head.parameters()) if head is not None else []
    head_ids = {id(p) for p in head_params}
    rows, embedding_names = [], []
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in head_ids:  # a tied head is the same tensor as the embedding
            continue
        if id(param) in embed_ids:
            embedding_names.append(name)
        rows.append((name, param.numel(), bool(param.requires_grad)))
    frozen, trainable = _split_parameters(rows, text_config.to_dict(), embedding_names)
    return StepParameters(
        frozen=frozen,
        trainable=trainable,
        head=int(sum(p.numel() for p in head_params)),
        head_trainable=any(p.requires_grad for p in head_params),
    )


def lora_step_flops(
    params: StepParameters, n_tokens: int, head_tokens: int, attention_flops: float
) -> StepFlops:
    """Model FLOPs of one step: 4 x frozen + 6 x trainable per token, the head on the positions
    it runs on, plus attention (see MFU_CONVENTION)."""
    head_per_param = 6 if params.head_trainable else 4
    return StepFlops(
        frozen=4.0 * params.frozen * n_tokens,
        trainable=6.0 * params.trainable * n_tokens,
        head=float(head_per_param) * params.head * head_tokens,
        attention=float(attention_flops),
        n_tokens=int(n_tokens),
        head_tokens=int(head_tokens),
    )


def head_positions_of(harness_module: Any) -> str:
    """Where the harness runs the LM head: its LM_HEAD_POSITIONS, else 'all' (stock loss)."""
    value = getattr(harness_module, HEAD_POSITIONS_ATTRIBUTE, "all")
    if value not in HEAD_POSITIONS:
        raise ValueError(
            f"harness {getattr(harness_module, '__name__', harness_module)}: "
            f"{HEAD_POSITIONS_ATTRIBUTE} = {value!r}; use one of {list(HEAD_POSITIONS)}"
        )
    return str(value)


def count_flops_by_op(step: Any) -> dict[str, int]:
    """Run `step()` under torch.utils.flop_counter.FlopCounterMode; FLOPs per ATen op."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    totals = counter.get_flop_counts().get("Global", {})
    return {str(op): int(value) for op, value in totals.items()}


COUNTER_BLIND = (
    "FlopCounterMode counted no matmul FLOPs in one real step of the harness: its work runs "
    "where the counter cannot see it (a custom or Triton kernel, a compiled region, a loss "
    "computed outside the model)"
)


def mfu_unverified_reason(
    passed: bool, counted_linear: float, ratio: float, tolerance: float, counter_error: str | None
) -> str | None:
    """Why the MFU figures are not verified by the FLOP counter, or None when they are."""
    if passed:
        return None
    if counter_error is not None:
        return f"FlopCounterMode failed on one real step ({counter_error}); MFU is unverified"
    if counted_linear <= 0:
        return f"{COUNTER_BLIND}; MFU is unverified (the timings stand)"
    return (
        f"the analytic FLOP count is {ratio:.3f} x what FlopCounterMode counted (tolerance "
        f"{tolerance:g}); MFU is unverified (the timings stand): if the harness runs the LM "
        "head on the loss positions only, set LM_HEAD_POSITIONS = 'loss' in it"
    )


def flop_counter_control(
    analytic: StepFlops,
    counted_by_op: Mapping[str, int],
    tolerance: float = FLOP_TOLERANCE,
    old_six_n_flops: float | None = None,
    shape: Mapping[str, Any] | None = None,
    recomputed_forward: bool = False,
    counter_error: str | None = None,
) -> dict[str, Any]:
    """The positive control for the FLOP count: analytic linear FLOPs / counted matmul FLOPs.

    With gradient checkpointing the counter also sees the recomputed forward of the decoder
    (2 per parameter per token of frozen and trainable weights), which MFU does not count; the
    comparison adds it so that the check still tests the convention."""
    counted_linear = float(sum(v for op, v in counted_by_op.items() if op in LINEAR_OPS))
    counted_total = float(sum(counted_by_op.values()))
    recompute = analytic.frozen / 2.0 + analytic.trainable / 3.0 if recomputed_forward else 0.0
    expected_linear = analytic.linear + recompute
    ratio = expected_linear / counted_linear if counted_linear > 0 else float("nan")
    passed = counted_linear > 0 and abs(ratio - 1.0) <= tolerance
    return {
        # This control guards MFU only: failing it marks MFU unverified (with the reason) and
        # leaves every timing standing (probes.profile.stage).
        "gates_stage": False,
        "mfu_unverified_reason": mfu_unverified_reason(
            passed, counted_linear, ratio, tolerance, counter_error
        ),
        "name": "analytic_flops_match_flop_counter",
        "description": (
            "one real training step (harness compute_loss + backward) under "
            "torch.utils.flop_counter.FlopCounterMode: the analytic linear-layer FLOPs of the "
            "MFU convention (4 x frozen + 6 x trainable per token + the head on the positions "
            "it runs on) over the counted aten.mm/addmm FLOPs must lie within 1 +- tolerance; "
            "attention is recorded, not gated (the counter counts the full square)"
        ),
        "expected": {"analytic_over_counted": 1.0, "tolerance": tolerance},
        "observed": {
            "analytic_over_counted": ratio,
            "analytic_linear_flops": analytic.linear,
            "recomputed_forward_flops": recompute,
            "counted_linear_flops": counted_linear,
            "analytic": analytic.as_dict(),
            "counted_total_flops": counted_total,
            "counted_by_op": dict(counted_by_op),
            "old_6n_flops": old_six_n_flops,
            "old_6n_over_counted_total": (
                old_six_n_flops / counted_total
                if old_six_n_flops is not None and counted_total > 0
                else None
            ),
            "shape": dict(shape or {}),
            "counter_error": counter_error,
            "hint": None
            if passed
            else (
                "the count and the convention disagree: if the harness runs the LM head on the "
                "loss positions only, set LM_HEAD_POSITIONS = 'loss' in it ('all' if it "
                "computes every position's logits); trainable weights count 6, frozen 4"
            ),
        },
        "passed": bool(passed),
    }
