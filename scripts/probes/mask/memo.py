"""Replay, on the meta device, the output of a decoder layer's attention-free submodules.

Used by ``probes.mask.trace``: a non-attention submodule of a decoder layer (a projection, a norm,
an MLP, experts) replays its meta output once its metadata has been seen, so a 62-layer model is
traced at the training shape in under a second per scenario without changing what reaches SDPA.
"""

from __future__ import annotations

from typing import Any

import torch


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "meta" else value.to("meta")
    if isinstance(value, tuple):
        return tuple(_to_meta(item) for item in value)
    if isinstance(value, list):
        return [_to_meta(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_meta(item) for key, item in value.items()}
    return value


class _MetaMemo:
    """Replay the meta output of a module for a call whose metadata was seen before.

    On the meta device a module's output is a function of its code, its parameters' and inputs'
    shapes/strides/dtypes, nothing else: there are no values. Decoder layers repeat the same norms,
    projections and MLPs 60 times over, and meta kernels cost ~0.5 ms each in Python, so the
    non-attention submodules replay their first result. Attention modules themselves always run:
    their calls into SDPA are what is recorded.
    """

    def __init__(self) -> None:
        self.cache: dict[Any, Any] = {}
        self.hits = 0

    @staticmethod
    def _signature(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                raise _NotMemoisable
            return ("T", tuple(value.shape), tuple(value.stride()), value.dtype)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(_MetaMemo._signature(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, _MetaMemo._signature(v)) for k, v in value.items())))
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise _NotMemoisable

    @staticmethod
    def _template(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                raise _NotMemoisable
            return ("T", tuple(value.shape), tuple(value.stride()), value.dtype)
        if isinstance(value, tuple) and type(value) is tuple:
            return ("tuple", tuple(_MetaMemo._template(v) for v in value))
        if value is None:
            return None
        raise _NotMemoisable

    @staticmethod
    def _replay(template: Any) -> Any:
        if template is None:
            return None
        if template[0] == "T":
            _, shape, stride, dtype = template
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return tuple(_MetaMemo._replay(t) for t in template[1])

    def wrap(self, module: torch.nn.Module) -> None:
        original = module.forward
        params = tuple(
            (name, tuple(t.shape), t.dtype)
            for name, t in list(module.named_parameters()) + list(module.named_buffers())
        )
        memo = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                key = (type(module), params, memo._signature(args), memo._signature(kwargs))
            except (_NotMemoisable, TypeError):
                return original(*args, **kwargs)
            if key in memo.cache:
                memo.hits += 1
                return memo._replay(memo.cache[key])
            output = original(*args, **kwargs)
            try:
                memo.cache[key] = memo._template(output)
            except _NotMemoisable:
                pass
            return output

        module.forward = forward

    def wrap_function(self, function: Any) -> Any:
        memo = self

        def memoised(*args: Any, **kwargs: Any) -> Any:
            try:
                key = (function, memo._signature(args), memo._signature(kwargs))
            except (_NotMemoisable, TypeError):
                return function(*args, **kwargs)
            if key in memo.cache:
                memo.hits += 1
                return memo._replay(memo.cache[key])
            output = function(*args, **kwargs)
            try:
                memo.cache[key] = memo._template(output)
            except _NotMemoisable:
                pass
            return output

        memoised.__wrapped__ = function
        return memoised


# Module-level helpers of modeling files that attention forwards call on q/k (pure tensor code).
MEMOISED_HELPERS = ("apply_rotary_pos_emb",)


class _NotMemoisable(Exception):
    pass


def _is_attention(module: torch.nn.Module) -> bool:
    # by class (Gemma3Attention, LlamaAttention...): names like post_attention_layernorm mislead
    lowered = type(module).__name__.lower()
    return "attn" in lowered or "attention" in lowered


def _contains_attention(module: torch.nn.Module) -> bool:
    return any(_is_attention(sub) for sub in module.modules())


def memoise_decoder_submodules(layers: torch.nn.ModuleList) -> _MetaMemo:
    """Replay the submodules of every decoder layer that hold no attention (see _MetaMemo).

    Attention modules, and anything containing one, always run: replaying them would skip the
    very SDPA calls being recorded. Their own attention-free children (projections, q/k norms)
    are replayed.
    """
    memo = _MetaMemo()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if _contains_attention(child):
                visit(child)
            else:
                memo.wrap(child)

    for layer in layers:
        visit(layer)
    return memo
