"""How the ranks hold the model: DDP (every rank a full replica, one gradient all-reduce per
optimizer step) or FSDP2 (``fully_shard``: parameters, gradients and optimizer states sharded,
all-gathered per layer in forward and backward, gradients reduce-scattered).

One home for the FSDP2 settings a user pastes: ``fsdp_config`` is the dict
``TrainingArguments(fsdp=True, fsdp_config=...)`` takes (transformers 5.x: ``version`` 2 is
FSDP2), ``accelerate_config`` the YAML ``accelerate launch --config_file`` reads; the
data_parallel stage trains with the first, the report prints both, and a test builds
``TrainingArguments`` from it against the installed transformers and accelerate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DDP = "ddp"
FSDP2 = "fsdp2"
SHARDINGS = (DDP, FSDP2)


def fsdp_config(
    layer_classes: Sequence[str] = (), reshard_after_forward: bool = True
) -> dict[str, Any]:
    """``TrainingArguments(fsdp=True, fsdp_config=...)`` for FSDP2: each decoder layer its own
    ``fully_shard`` unit (``layer_classes``; none named: the model's ``_no_split_modules``, as
    accelerate's transformer-based wrap takes them), parameters resharded after forward or
    kept for backward."""
    config: dict[str, Any] = {"version": 2, "reshard_after_forward": bool(reshard_after_forward)}
    if layer_classes:
        config["transformer_layer_cls_to_wrap"] = list(layer_classes)
    return config


def training_arguments(sharding: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The TrainingArguments fields a sharding sets (none for DDP: torchrun alone makes the
    trainer's accelerator wrap the model in DistributedDataParallel)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r} is not one of {list(SHARDINGS)}")
    if sharding == DDP:
        return {}
    return {"fsdp": True, "fsdp_config": config or fsdp_config()}


def accelerate_config(
    world_size: int,
    layer_classes: Sequence[str] = (),
    reshard_after_forward: bool = True,
    mixed_precision: str = "bf16",
) -> str:
    """The ``accelerate launch --config_file`` YAML for FSDP2 on ``world_size`` GPUs of one
    machine (accelerate's own key names, ``accelerate config`` writes the same)."""
    lines = [
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: FSDP",
        f"mixed_precision: {mixed_precision}",
        "num_machines: 1",
        f"num_processes: {int(world_size)}",
        "fsdp_config:",
        "  fsdp_version: 2",
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
        f"  fsdp_reshard_after_forward: {'true' if reshard_after_forward else 'false'}",
        "  fsdp_state_dict_type: SHARDED_STATE_DICT",
    ]
    if layer_classes:
        lines.append(f"  fsdp_transformer_layer_cls_to_wrap: {','.join(layer_classes)}")
    return "\n".join(lines) + "\n"


def layer_classes(config: Any) -> list[str]:
    """The decoder layer classes of the causal LM ``config`` builds (its ``_no_split_modules``,
    read from the class: no weights); [] where transformers has no causal LM for it."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return []
    return [str(name) for name in (getattr(model_class, "_no_split_modules", None) or [])]


def lift_cpu_gate(trainer: Any) -> bool:
    """Let a trainer built with ``fsdp_config`` run FSDP2 on CPU ranks (gloo).

    accelerate turns an FSDP plugin on only for accelerator devices (``AcceleratorState``: a
    MULTI_CPU job keeps DDP and drops the plugin silently), while ``fully_shard`` itself runs
    on CPU. On a CPU job this sets the state's distributed type to FSDP with the plugin the
    trainer's own arguments give (``args.fsdp_plugin_args``); the wrap, ``no_sync``, clipping
    and optimizer are then accelerate's FSDP2 code as on GPUs. True where it lifted the gate.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    state = trainer.accelerator.state
    if not plugin_args or trainer.is_fsdp_enabled:
        return False
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    trainer.is_fsdp_enabled = True
    return True
