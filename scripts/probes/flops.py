"""Model FLOPs for MFU: 6 x active parameters x tokens, plus the attention score/value matmuls.

Active parameters are the ones a token's matmuls touch: the input embedding is a lookup (not
counted) but the LM head is a matmul (counted once, also when tied to the embedding); in an MoE
only experts_per_token / num_experts of the routed expert weights run per token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
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
    """per_param x N x tokens + attention (6: forward 2 + backward 4 = the MFU convention)."""
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
