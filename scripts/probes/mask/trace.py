"""Build a model's real architecture without weights and record what its attention layers call.

The model comes from its config.json alone. It is built on the meta device at its real sizes
(real layer count, layer types, heads, head_dim, hidden size, experts), so no weight is read and
no decoder-layer compute is done. Only what runs *before* the decoder layers (embeddings, rotary
tables, and the model's own mask construction) is materialised on the CPU, with the vocabulary
shrunk, because that is where transformers builds the masks from the 2-D padding mask and
position ids. A pre-hook moves each decoder layer's inputs to the meta device, except the mask,
so the layer's attention reaches ``scaled_dot_product_attention`` with meta q/k/v (real shapes,
strides, dtype) and the real CPU mask tensor. That call is recorded and answered with an empty
tensor; the forward stops after the last decoder layer.

Two shortcuts keep a 62-layer model at the training shape under a second per scenario, neither
changing what reaches SDPA: the embedding lookup runs on the first token and is broadcast over
the sequence (values are never read), and non-attention submodules of the decoder layers replay
their meta output once its metadata has been seen (``probes.mask.memo``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from probes.errors import ProbeError
from probes.mask import flex
from probes.mask.backend import SdpaCall
from probes.mask.memo import (  # noqa: F401  (_MetaMemo: bench/mask_large.py replaces the memo)
    MEMOISED_HELPERS,
    _is_attention,
    _MetaMemo,
    _to_meta,
    memoise_decoder_submodules,
)

SHRUNK_VOCAB = 512  # embedding tables are the only weights materialised; values never matter
SKIP_SUBTREES = ("vision", "visual", "audio", "image", "video", "speech")


class ModelConfigError(ProbeError, ValueError):
    """A config.json that cannot be turned into a model; the message names file and key."""


class _StopAfterDecoder(Exception):
    """Raised after the last decoder layer: nothing later affects attention."""


@dataclass
class AttentionRecord:
    """One attention call of one decoder layer, as the model made it."""

    layer_idx: int
    implementation: str  # "sdpa", "eager" or "flex_attention"
    call: SdpaCall | None = None  # what reached scaled_dot_product_attention (None for eager)
    # the mask tensor SDPA (or eager attention) received; flex: what its BlockMask attends
    mask: torch.Tensor | None = None
    module_sliding_window: int | None = None  # what the attention module passed as sliding_window
    q_heads: int | None = None
    kv_heads: int | None = None  # before any repeat_kv: the module's real KV heads
    head_dim: int | None = None
    softcap: float | None = None


@dataclass
class ProbeModel:
    model: torch.nn.Module
    config: Any  # the top-level config (may be a multimodal wrapper)
    text_config: Any  # the decoder's config
    layers: torch.nn.ModuleList
    attn_implementation: str
    sdpa_supported: bool
    sdpa_unsupported_reason: str | None
    accepts_token_type_ids: bool
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    memo: Any = None  # _MetaMemo of the decoder submodules
    config_dict: dict[str, Any] = field(default_factory=dict)  # the config.json it was built from
    source: str = "config.json"

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ModelConfigError(f"{path}: file not found; give the model's config.json") from error
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{path}: not valid JSON (line {error.lineno}: {error.msg}); give the model's "
            "config.json"
        ) from error
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelConfigError(
            f"{path}: key 'model_type' missing; a Hugging Face config.json names its model_type"
        )
    return data


def config_from_dict(data: dict[str, Any], source: str = "config.json") -> Any:
    """A transformers config object from a config.json dict (multimodal wrappers included)."""
    from transformers import CONFIG_MAPPING

    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        import transformers

        raise ModelConfigError(
            f"{source}: model_type '{model_type}' is unknown to transformers "
            f"{transformers.__version__}; upgrade transformers or check the key 'model_type'"
        )
    fields = {key: value for key, value in data.items() if key != "model_type"}
    return CONFIG_MAPPING[model_type].from_dict(fields)


def _shrink_vocab(config: Any) -> None:
    # Only the embedding tables are materialised; a 262k x 5376 table would cost gigabytes for
    # values nothing reads. Token ids in the scenarios stay below SHRUNK_VOCAB.
    for key, value in list(config.to_dict().items()):
        if "vocab_size" in key and isinstance(value, int) and value > SHRUNK_VOCAB:
            setattr(config, key, SHRUNK_VOCAB)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and pad >= SHRUNK_VOCAB:
        config.pad_token_id = None


def _find_decoder_layers(
    model: torch.nn.Module, num_layers: int
) -> tuple[str, torch.nn.ModuleList]:
    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) != num_layers:
            continue
        if any(part in name.lower() for part in SKIP_SUBTREES):
            continue
        # hybrid stacks (linear-attention layers in between) count if any layer attends
        has_attention = any(_is_attention(c) for layer in module for c in layer.children())
        if has_attention:
            candidates.append((name, module))
    if not candidates:
        raise ModelConfigError(
            f"found no list of {num_layers} decoder layers with an attention module in "
            f"{type(model).__name__}; this architecture is not supported by the mask gate"
        )
    # the shallowest match is the decoder stack (deeper ones would be nested sub-blocks)
    return min(candidates, key=lambda item: item[0].count("."))


def _materialise_on_cpu(module: torch.nn.Module) -> None:
    """Give a meta submodule real (zero) CPU storage; its values are never read by a mask."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.zero_()


def _build(config: Any, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    from transformers import AutoModel

    with torch.device("meta"):
        return AutoModel.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def _build_default(config: Any, dtype: torch.dtype) -> tuple[torch.nn.Module, str | None]:
    """SDPA, or eager where the architecture refuses SDPA: (model, why SDPA was refused)."""
    try:
        return _build(config, dtype, "sdpa"), None
    except (ValueError, ImportError) as error:
        if "scaled_dot_product_attention" not in str(error) and "sdpa" not in str(error).lower():
            raise
        # e.g. Gemma 2: softcapping is not expressible in SDPA, so transformers runs eager
        return _build(config, dtype, "eager"), str(error).splitlines()[0][:300]


def build_probe_model(
    config_dict: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    source: str = "config.json",
    attn_implementation: str | None = None,
) -> ProbeModel:
    """The model's real architecture on the meta device, pre-decoder parts on the CPU, with
    `attn_implementation` (None: SDPA, or eager where the architecture refuses SDPA). An
    implementation the architecture or this machine refuses raises transformers' own error."""
    config = config_from_dict(config_dict, source)
    text_config = config.get_text_config(decoder=True)
    for cfg in {id(config): config, id(text_config): text_config}.values():
        _shrink_vocab(cfg)
    notes: list[str] = []
    if attn_implementation is None:
        model, reason = _build_default(config, dtype)
        sdpa_supported = reason is None
        if reason:
            notes.append(
                f"SDPA unsupported by this architecture in transformers; traced eager: {reason}"
            )
        implementation = "sdpa" if sdpa_supported else "eager"
    else:
        model = _build(config, dtype, attn_implementation)
        sdpa_supported, reason = attn_implementation == "sdpa", None
        implementation = attn_implementation
    layers_name, layers = _find_decoder_layers(model, text_config.num_hidden_layers)
    parent_name = layers_name.rsplit(".", 1)[0] if "." in layers_name else ""
    text_model = model.get_submodule(parent_name) if parent_name else model
    for child in text_model.children():
        if child is layers:
            continue
        if _is_rotary(child):
            _rotary_on_meta(child)
        else:
            _materialise_on_cpu(child)
    for name, param in list(text_model.named_parameters(recurse=False)):
        setattr(text_model, name, torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype)))
    for name, buffer in list(text_model.named_buffers(recurse=False)):
        text_model.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype))
    memo = memoise_decoder_submodules(layers)
    _broadcast_embeddings(model)
    model.train()  # a training step: dropout probabilities as the trainer would pass them
    accepts_tti = "token_type_ids" in inspect.signature(model.forward).parameters
    return ProbeModel(
        model=model,
        config=config,
        text_config=text_config,
        layers=layers,
        attn_implementation=implementation,
        sdpa_supported=sdpa_supported,
        sdpa_unsupported_reason=reason,
        accepts_token_type_ids=accepts_tti and config is not text_config,
        dtype=dtype,
        notes=notes,
        memo=memo,
        config_dict=config_dict,
        source=source,
    )


def _is_rotary(module: torch.nn.Module) -> bool:
    return "rotary" in type(module).__name__.lower()


def _rotary_on_meta(module: torch.nn.Module) -> None:
    """Rotary tables on the meta device: they reach only the decoder layers (which run on meta)
    and masks never read them; computed on the CPU they cost 0.1 s a forward at T = 1024."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*_to_meta(args), **_to_meta(kwargs))

    module.forward = forward


@contextmanager
def implementation_of(probe: ProbeModel, implementation: str) -> Iterator[ProbeModel]:
    """The probe's model with `implementation`, switched in place by transformers (and back
    after); a model that cannot switch is built anew. Raises what transformers raises for an
    implementation it refuses here."""
    import dataclasses

    before = probe.attn_implementation
    if implementation == before:
        yield probe
        return
    probe.model.set_attn_implementation(implementation)
    try:
        if _implementation_now(probe.model) == implementation:
            yield dataclasses.replace(
                probe,
                attn_implementation=implementation,
                sdpa_supported=implementation == "sdpa",
                sdpa_unsupported_reason=None,
            )
        else:  # transformers only warned: this architecture switches at build time only
            yield build_probe_model(probe.config_dict, probe.dtype, probe.source, implementation)
    finally:
        if _implementation_now(probe.model) != before:
            probe.model.set_attn_implementation(before)


def _implementation_now(model: torch.nn.Module) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def _broadcast_embeddings(model: torch.nn.Module) -> None:
    """Look up the first token only and broadcast it over the sequence.

    The embedding output feeds the masks only through its shape, dtype and device, and the
    decoder layers run on meta; a (B, T, hidden) lookup at real hidden size is wasted time.
    """
    embeddings = model.get_input_embeddings()
    original = embeddings.forward

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output = original(input_ids[..., :1], *args, **kwargs)
        if not isinstance(output, torch.Tensor) or output.dim() != input_ids.dim() + 1:
            return original(input_ids, *args, **kwargs)
        return output.expand(*input_ids.shape, output.shape[-1])

    embeddings.forward = forward


def _is_mask(name: str | None, value: Any) -> bool:
    return name == "attention_mask" or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4
    )


def _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> SdpaCall:
    return SdpaCall(
        q_shape=tuple(query.shape),
        k_shape=tuple(key.shape),
        v_shape=tuple(value.shape),
        q_stride=tuple(query.stride()),
        k_stride=tuple(key.stride()),
        v_stride=tuple(value.stride()),
        dtype=str(query.dtype).removeprefix("torch."),
        is_causal=bool(is_causal),
        enable_gqa=bool(enable_gqa),
        dropout_p=float(dropout_p),
        mask_shape=None if attn_mask is None else tuple(attn_mask.shape),
        mask_dtype=None if attn_mask is None else str(attn_mask.dtype).removeprefix("torch."),
        mask_last_stride=None if attn_mask is None else int(attn_mask.stride(-1)),
    )


def _patch_helpers(probe: ProbeModel) -> list[tuple[Any, str, Any]]:
    """Memoise MEMOISED_HELPERS in the attention modules' Python modules; what to restore."""
    import sys

    patches = []
    for module_name in {
        type(m).__module__ for layer in probe.layers for m in layer.children() if _is_attention(m)
    }:
        python_module = sys.modules.get(module_name)
        for helper in MEMOISED_HELPERS:
            function = getattr(python_module, helper, None)
            if callable(function):
                patches.append((python_module, helper, function))
                setattr(python_module, helper, probe.memo.wrap_function(function))
    return patches


class _Recorder:
    """The replacements _recording installs: they append an AttentionRecord per attention call
    (the decoder layer it ran in, set by a pre-hook) and compute nothing."""

    def __init__(self, records: list[AttentionRecord], original_sdpa_interface: Any) -> None:
        self.records = records
        self.original_sdpa_interface = original_sdpa_interface
        self.layer: int | None = None
        self.record: AttentionRecord | None = None
        self.flex_dense: dict[int, tuple[Any, torch.Tensor]] = {}  # BlockMask id -> dense

    def new_record(self, implementation: str, query, key, kwargs) -> AttentionRecord:
        record = AttentionRecord(
            layer_idx=self.layer if self.layer is not None else -1,
            implementation=implementation,
            module_sliding_window=kwargs.get("sliding_window"),
            q_heads=int(query.shape[1]),
            kv_heads=int(key.shape[1]),
            head_dim=int(query.shape[-1]),
            softcap=kwargs.get("softcap"),
        )
        self.records.append(record)
        return record

    def sdpa_interface(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.record = self.new_record("sdpa", query, key, kwargs)
        try:
            return self.original_sdpa_interface(
                module, query, key, value, attention_mask, *args, **kwargs
            )
        finally:
            self.record = None

    def eager_interface(self, module, query, key, value, attention_mask, *args, **kwargs):
        record = self.new_record("eager", query, key, kwargs)
        record.mask = attention_mask
        batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
        out = torch.empty(
            batch, q_len, heads, value.shape[-1], dtype=query.dtype, device=query.device
        )
        return out, None

    def flex_interface(self, module, query, key, value, attention_mask, *args, **kwargs):
        record = self.new_record(flex.FLEX, query, key, kwargs)
        if attention_mask is not None:  # the same BlockMask for every layer of one type
            cached = self.flex_dense.get(id(attention_mask))
            if cached is None or cached[0] is not attention_mask:
                cached = (attention_mask, flex.dense_allowed(attention_mask))
                self.flex_dense[id(attention_mask)] = cached
            record.mask = cached[1]
        batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
        out = torch.empty(
            batch, q_len, heads, value.shape[-1], dtype=query.dtype, device=query.device
        )
        return out, None

    def recorded_sdpa(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        record = self.record
        if record is None:  # a model calling SDPA directly, not through the interface
            record = self.new_record("sdpa", query, key, {})
        record.call = _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        record.mask = attn_mask
        shape = (*query.shape[:-1], value.shape[-1])
        return torch.empty(shape, dtype=query.dtype, device=query.device)

    def pre_hook(self, index: int):
        def hook(module, args, kwargs):
            self.layer = index
            new_args = tuple(arg if _is_mask(None, arg) else _to_meta(arg) for arg in args)
            new_kwargs = {k: v if _is_mask(k, v) else _to_meta(v) for k, v in kwargs.items()}
            return new_args, new_kwargs

        return hook

    @staticmethod
    def stop_hook(module, args, output):
        raise _StopAfterDecoder


@contextmanager
def _recording(probe: ProbeModel, records: list[AttentionRecord]) -> Iterator[None]:
    """Patch SDPA and the attention interface, hook the decoder layers; undo everything after."""
    from transformers.modeling_utils import AttentionInterface

    helper_patches = _patch_helpers(probe)
    mapping = AttentionInterface._global_mapping
    original_sdpa_interface = mapping["sdpa"]
    originals = {name: mapping.get(name) for name in ("eager", flex.FLEX)}
    original_sdpa = F.scaled_dot_product_attention
    recorder = _Recorder(records, original_sdpa_interface)
    handles = [
        layer.register_forward_pre_hook(recorder.pre_hook(index), with_kwargs=True)
        for index, layer in enumerate(probe.layers)
    ]
    handles.append(probe.layers[-1].register_forward_hook(recorder.stop_hook))
    mapping["sdpa"] = recorder.sdpa_interface
    mapping["eager"] = recorder.eager_interface
    mapping[flex.FLEX] = recorder.flex_interface
    F.scaled_dot_product_attention = recorder.recorded_sdpa
    try:
        with flex.uncompiled_block_masks():
            yield
    finally:
        F.scaled_dot_product_attention = original_sdpa
        mapping["sdpa"] = original_sdpa_interface
        for python_module, helper, function in helper_patches:
            setattr(python_module, helper, function)
        for name, function in originals.items():
            if function is None:
                mapping.pop(name, None)
            else:
                mapping[name] = function
        for handle in handles:
            handle.remove()


def trace_attention(
    probe: ProbeModel, inputs: dict[str, torch.Tensor | None]
) -> list[AttentionRecord]:
    """Run the model's forward on `inputs` and return every decoder-layer attention call."""
    records: list[AttentionRecord] = []
    kwargs = {key: value for key, value in inputs.items() if value is not None}
    with _recording(probe, records), torch.inference_mode():
        try:
            probe.model(**kwargs, use_cache=False)
        except _StopAfterDecoder:
            pass
    return [record for record in records if record.layer_idx >= 0]
