"""Each rank's peak memory under FSDP2 at world size W, predicted without GPUs or weights.

torch's own machinery, not a formula: a fake process group (`FakeStore` +
`init_process_group("fake")`: collectives return at once, nothing is sent), the real
`fully_shard` on a model built on the meta device and materialised as fake tensors
(`FakeTensorMode`), and torch's `FSDPMemTracker` over one training step of rank 0 (it follows
FSDP2's all-gather and reduce-scatter buffers and the storages FSDP frees by resizing them to 0,
which no dispatch mode sees). The harness's own functions run the step, as in
`probes.memory.predict`; the project's `StepTracker` is stacked inside only to answer the
harness's boolean index with the shape's loss positions.

How the model is sharded (what accelerate does for a transformers model with FSDP2): one
`fully_shard` per decoder layer (the classes of `model._no_split_modules`, accelerate's default
`transformer_layer_cls_to_wrap`), then the root. The root is `LossRoot`, a module whose forward is
the harness's `compute_loss`: the reference harness calls the decoder and reads the LM head's
weight itself (its chunked loss), which a root on the model would never see unsharded, so the
root wraps the whole loss as a Trainer's root wraps `model(**inputs)`. The embeddings, the final
norm and the LM head (tied or not) are the root's, sharded like the layers.

Assumed where fake tensors cannot know: every rank holds rank 0's shard sizes (FSDP2 pads the
last shard, so they differ by at most one row per parameter); tensors are not rounded to the CUDA
allocator's blocks; communication buffers are FSDP2's own tensors (a NCCL kernel's internal
workspace is not a tensor and is not counted).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from probes.memory.predict import (
    DTYPES,
    PredictError,
    Shape,
    StepFunctions,
    fake_errors,
    make_batch,
    warm_optimizer,
)
from probes.memory.tracker import StepTracker

TOTAL = "Total"
# The sharded traces scale from two layers of each type: with one, the base's peak has no layer
# to prefetch the next all-gather for, so its composition differs from every larger model's.
SCALE_FROM = 2


@dataclass(frozen=True)
class Sharding:
    """FSDP2 at `world_size` ranks; `reshard_after_forward` as `fully_shard` takes it."""

    world_size: int
    reshard_after_forward: bool = True

    @property
    def name(self) -> str:
        return f"fsdp2_w{self.world_size}" + ("" if self.reshard_after_forward else "_no_reshard")


@dataclass
class ShardedPrediction:
    sharding: Sharding
    shape: Shape
    peak_bytes: int
    by_kind: dict[str, int]  # FSDPMemTracker's reference types at the peak
    seconds: float
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake process group of `world_size` ranks (this process is rank 0) and its CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1:
        raise PredictError(f"memory.world_sizes: {world_size} is not a number of ranks (>= 1)")
    if dist.is_initialized():
        raise PredictError(
            "a process group is already initialised in this process: the sharded prediction "
            "needs its own fake one; run the memory stage outside torchrun"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def layer_classes(model: nn.Module) -> set[str]:
    """The decoder layer classes FSDP2 wraps one by one: transformers' `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    if not names:
        raise PredictError(
            f"{type(base).__name__} names no decoder layer class (_no_split_modules): there is "
            "no per-layer FSDP2 unit to predict"
        )
    return names


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The text decoder's layers: a multimodal wrapper's other towers, which the text step never
    runs, stay in the root's group (gathered with it: an upper bound for their part), since a
    unit that never runs forward leaves FSDP2's post-backward nothing to reshard."""
    classes = layer_classes(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    units = [m for m in decoder.modules() if type(m).__name__ in classes]
    if not units:
        raise PredictError(f"no module of {sorted(classes)} in the text decoder to shard")
    return units


class LossRoot(nn.Module):
    """FSDP2's root: its forward is the harness's loss on the model (see the module's doc)."""

    def __init__(self, model: nn.Module, compute_loss: Any) -> None:
        super().__init__()
        self.model = model
        self.compute_loss = compute_loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.compute_loss(self.model, batch)


def shard(model: nn.Module, compute_loss: Any, mesh: Any, sharding: Sharding) -> LossRoot:
    """`fully_shard` each decoder layer, then the root around the loss; returns the root."""
    from torch.distributed.fsdp import fully_shard

    units = layer_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=sharding.reshard_after_forward)
    root = LossRoot(model, compute_loss)
    fully_shard(root, mesh=mesh, reshard_after_forward=sharding.reshard_after_forward)
    return root


def build_model(
    config: Any, functions: StepFunctions, dtype: str, attn_implementation: str
) -> nn.Module:
    """The architecture on the meta device with the harness's adapters (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
        if functions.apply_adapters is not None:
            model = functions.apply_adapters(model, functions.discover_target_modules(model))
    return model


def predict_sharded(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    shape: Shape,
    sharding: Sharding,
    attn_implementation: str = "sdpa",
    grad_accum: int = 1,
) -> ShardedPrediction:
    """Rank 0's peak over one FSDP2 training step at `shape` (its micro-batch), fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if dtype not in DTYPES:
        raise PredictError(f"mask.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    start = time.perf_counter()
    with fake_process_group(sharding.world_size) as mesh:
        model = build_model(config, functions, dtype, attn_implementation)
        units = len(layer_units(model))  # before fully_shard renames their classes (FSDP...)
        root = shard(model, functions.compute_loss, mesh, sharding)
        with FakeTensorMode(allow_non_fake_inputs=True), fake_errors(shape):
            root.to_empty(device="cpu")  # fully_shard's own _apply keeps the shards DTensors
            root.train()
            optimizer = (functions.build_optimizer or _adamw)(model)
            warm_optimizer(model, optimizer)
            by_kind = tracked_step(root, optimizer, shape, grad_accum)
    notes = [f"FSDP2 over {sharding.world_size} rank(s): {units} layer units and the root"]
    return ShardedPrediction(
        sharding, shape, by_kind[TOTAL], by_kind, time.perf_counter() - start, notes
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def tracked_step(
    root: LossRoot, optimizer: torch.optim.Optimizer, shape: Shape, grad_accum: int
) -> dict[str, int]:
    """One step (forward with the harness's loss, backward, optimizer) under FSDPMemTracker;
    the peak's bytes by reference type (parameters sharded/unsharded, gradients, optimizer
    state, activations, temporaries, all-gather and reduce-scatter buffers, inputs), Total."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if grad_accum > 1:  # the earlier micro-batches' gradients, sharded, are live
        for param in root.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    batch = make_batch(shape)
    tracker = FSDPMemTracker(mod=root, optm=optimizer)
    tracker.track_inputs((batch,))
    with tracker, StepTracker(true_count=shape.loss_positions()):
        loss = root(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return {str(kind).split(".")[-1]: int(nbytes) for kind, nbytes in snapshot.items()}


def predict_sharded_scaled(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    shape: Shape,
    sharding: Sharding,
    attn_implementation: str = "sdpa",
    grad_accum: int = 1,
) -> ShardedPrediction:
    """`predict_sharded` on reduced models scaled per layer type, as `probes.memory.layers`
    scales the one-process figure, from SCALE_FROM layers of each type: one more of each type in
    turn, the line checked against one more of every type to the byte (more than one type), and
    the whole model traced where it misses or where the reduced traces are not fewer layers."""
    from probes.memory.layers import layer_types, reduced_config, reduced_types

    start = time.perf_counter()
    full = layer_types(config)
    counts = {t: full.count(t) for t in dict.fromkeys(full)}

    def at(layer_counts: dict[str, int] | None) -> ShardedPrediction:
        reduced = config
        if layer_counts is not None:
            reduced = reduced_config(config, reduced_types(full, layer_counts))
        return predict_sharded(
            reduced, functions, dtype, shape, sharding, attn_implementation, grad_accum
        )

    low = SCALE_FROM  # layers of each type in the base trace
    k = len(counts)
    traced = k * low + k * (k * low + 1) + (k * (low + 1) if k > 1 else 0)
    if traced >= len(full):
        return at(None)
    lows = dict.fromkeys(counts, low)
    base = at(lows)
    extra = {t: at({**lows, t: low + 1}) for t in counts}
    kinds = set(base.by_kind).union(*(p.by_kind for p in extra.values()))

    def line(layer_counts: dict[str, int]) -> dict[str, int]:
        out = {}
        for kind in kinds:
            value = base.by_kind.get(kind, 0)
            for t, found in extra.items():
                step = found.by_kind.get(kind, 0) - base.by_kind.get(kind, 0)
                value += (layer_counts[t] - low) * step
            out[kind] = value
        return out

    if k > 1:
        highs = dict.fromkeys(counts, low + 1)
        missed = line(highs)[TOTAL] - at(highs).by_kind[TOTAL]
        if missed:
            whole = at(None)
            words = f"{missed / 2**30:+.4f} GiB"
            whole.notes.insert(
                0,
                f"the whole model traced: the per-layer-type line missed a trace of {low + 1} "
                f"layers of each type by {words}",
            )
            whole.seconds = time.perf_counter() - start
            return whole
    by_kind = line(counts)
    note = (f"FSDP2 over {sharding.world_size} rank(s): traces of {low} and {low + 1} layers "
            f"of each type scaled per layer type to the model's {len(full)}")  # fmt: skip
    return ShardedPrediction(sharding, shape, by_kind[TOTAL], by_kind,
                             time.perf_counter() - start, [note])  # fmt: skip
