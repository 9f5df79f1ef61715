"""Reference training harness: what the profile stage imports when `profile.harness` is not set.

A harness is the user's own training module. The profile imports these functions and calls them
for every timed step (it never re-implements the step, because a probe that does measures itself):

- ``discover_target_modules(model) -> list[str]``  (required) module names to adapt
- ``compute_loss(model, batch) -> torch.Tensor``     (required) the scalar training loss; `batch`
  holds input_ids, attention_mask, labels (-100 on tokens without loss) and, for packed
  sequences, position_ids that restart at 0 for each document (then no attention_mask)
- ``apply_adapters(model, target_modules) -> model`` (optional) wrap the model for training
- ``build_optimizer(model) -> torch.optim.Optimizer`` (optional)
- ``loss_from_hidden(model, hidden, labels) -> torch.Tensor`` (optional) the head + loss part
  alone, so the stage can time it on real hidden states
- ``configure(options: dict) -> None`` (optional) receives `profile.harness_options` plus
  `ce_chunk_tokens`
- ``LM_HEAD_POSITIONS = "loss" | "all"`` (optional attribute, default "all") where compute_loss
  runs the LM head: on the loss positions only, or on every position (the stock causal-LM
  loss). MFU counts the head's FLOPs on these positions; a FLOP counter checks it.
- ``LOSS_KERNELS = ("chunked", "stock", ...)`` (optional attribute) the values its configure
  accepts under the option ``loss_kernel``, its default first: the replay prices the other one
  as a step-level change (probes.step.loss_changes), flipping it through configure.

This one: LoRA via peft on the attention and MLP projections (never embeddings, the LM head or
MoE routers); loss over the labelled tokens only, with a chunked cross-entropy that never holds
the full logits (``loss_kernel: chunked``, the default), or the stock loss (``loss_kernel:
stock``: the model's own forward with labels, full logits over every position, then its own
loss function).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probes.step.ce import (
    chunked_linear_cross_entropy,
    full_logits_cross_entropy,
    shifted_loss_positions,
)

# Leaf names of the attention and MLP projections across common decoder families.
PROJECTION_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "query_key_value",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "w1",
        "w2",
        "w3",
        "c_attn",
        "c_proj",
        "c_fc",
        "fc1",
        "fc2",
        "dense",
        "dense_h_to_4h",
        "dense_4h_to_h",
        "out_proj",
    }
)
# Never adapted: embeddings, the LM head, MoE routers, other modalities' towers.
EXCLUDED_PARTS = frozenset(
    {"embed_tokens", "lm_head", "router", "gate", "wte", "wpe", "embed_out", "output"}
)
EXCLUDED_SUBSTRINGS = ("vision", "audio", "multi_modal_projector", "router")

LOSS_OPTION = "loss_kernel"
CHUNKED, STOCK = "chunked", "stock"
LOSS_KERNELS = (CHUNKED, STOCK)  # the default first
DEFAULT_OPTIONS: dict[str, Any] = {
    LOSS_OPTION: CHUNKED,
    "ce_chunk_tokens": 1024,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "learning_rate": 1e-4,
    "gradient_checkpointing": False,
}
OPTIONS: dict[str, Any] = dict(DEFAULT_OPTIONS)
# where compute_loss runs the head: the chunked loss on the loss positions only (never the full
# logits), the stock loss on every position; configure keeps it in step with loss_kernel
HEAD_POSITIONS = {CHUNKED: "loss", STOCK: "all"}
LM_HEAD_POSITIONS = HEAD_POSITIONS[CHUNKED]


def configure(options: dict[str, Any]) -> None:
    """Reset to the defaults, then apply `options` (so a second run never inherits the first's)."""
    global LM_HEAD_POSITIONS
    unknown = set(options) - set(DEFAULT_OPTIONS)
    if unknown:
        raise ValueError(
            f"profile.harness_options: unknown key(s) {sorted(unknown)} for the reference "
            f"harness; known: {sorted(DEFAULT_OPTIONS)}"
        )
    kernel = options.get(LOSS_OPTION, DEFAULT_OPTIONS[LOSS_OPTION])
    if kernel not in LOSS_KERNELS:
        raise ValueError(
            f"profile.harness_options.{LOSS_OPTION}: {kernel!r} is not one of {list(LOSS_KERNELS)}"
        )
    OPTIONS.clear()
    OPTIONS.update(DEFAULT_OPTIONS, **options)
    LM_HEAD_POSITIONS = HEAD_POSITIONS[kernel]


def discover_target_modules(model: nn.Module) -> list[str]:
    """Full names of the nn.Linear attention/MLP projections of the language model."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        if parts[-1] not in PROJECTION_NAMES:
            continue
        if EXCLUDED_PARTS.intersection(parts) or any(s in name for s in EXCLUDED_SUBSTRINGS):
            continue
        names.append(name)
    if not names:
        raise ValueError(
            "reference harness: no attention/MLP projection (nn.Linear named q_proj, up_proj, ...) "
            "found in the model; give profile.harness your own discover_target_modules"
        )
    return names


def apply_adapters(model: nn.Module, target_modules: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    if OPTIONS["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = LoraConfig(
        r=int(OPTIONS["lora_r"]),
        lora_alpha=int(OPTIONS["lora_alpha"]),
        lora_dropout=float(OPTIONS["lora_dropout"]),
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=float(OPTIONS["learning_rate"]))


def _base_model(model: nn.Module) -> nn.Module:
    # a peft wrapper forwards attributes, but get_base_model() is the unambiguous way through
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _softcap(model: nn.Module) -> float | None:
    config = _base_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "final_logit_softcapping", None)


def loss_from_hidden(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over labelled tokens from the last hidden states: chunked through the LM head,
    or (stock) the head over every position, then the mean CE of the full logits."""
    head = _base_model(model).get_output_embeddings()
    if OPTIONS[LOSS_OPTION] == STOCK:
        return full_logits_cross_entropy(hidden, head, labels, _softcap(model))
    loss_hidden, targets = shifted_loss_positions(hidden, labels)
    total = chunked_linear_cross_entropy(
        loss_hidden, head, targets, int(OPTIONS["ce_chunk_tokens"]), _softcap(model)
    )
    return total / max(int(targets.numel()), 1)


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder without its head (so no full logits), then the chunked head + loss; or
    (stock) the model's own forward with labels: full logits, the model's own loss."""
    if OPTIONS[LOSS_OPTION] == STOCK:
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
            labels=batch["labels"],
            use_cache=False,
        ).loss
    decoder = _base_model(model).get_decoder()
    outputs = decoder(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        use_cache=False,
    )
    return loss_from_hidden(model, outputs[0], batch["labels"])
