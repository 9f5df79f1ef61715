"""The peak memory of one training step, predicted from config.json on fake tensors.

The real architecture is built on the meta device (no weights, no init), the harness's own
`discover_target_modules` / `apply_adapters` / `build_optimizer` / `compute_loss` run on it as the
profile runs them, and every parameter and buffer becomes a fake CPU tensor of its real size and
dtype (`FakeTensorMode`: shapes, no data). One whole step runs under `StepTracker`: forward with
the loss, backward, the optimizer step with its states. The optimizer's states exist before the
step (one warm step on zero gradients), as from the second step of a run on; with grad_accum > 1
the gradients of the earlier micro-batches are live too.

What fake CPU tensors cannot tell: the attention kernel is the CPU build's fused one
(`_scaled_dot_product_flash_attention_for_cpu`: output plus a float32 logsumexp per head and
position, as flash / cuDNN / memory-efficient save on the GPU); a GPU allocator's rounding is
applied by `round_to`; kernels' internal workspaces are not tensors and are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from probes.errors import ProbeError
from probes.memory.tracker import (
    BACKWARD,
    CATEGORIES,
    FORWARD,
    OPTIMIZER_STEP,
    StepTracker,
    categories_for,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PADDED, PACKED = "padded", "packed"  # the layouts of probes.batching.plans


class PredictError(ProbeError, ValueError):
    """The step cannot be predicted on fake tensors; the message names the op or key."""


@dataclass(frozen=True)
class Shape:
    """One micro-batch shape: `rows` x `length` (padded) or one row of `length` (packed)."""

    name: str
    rows: int
    length: int
    layout: str = PADDED
    loss_tokens: int | None = None  # None: every position but the first of each row

    def loss_positions(self) -> int:
        most = self.rows * max(self.length - 1, 0)
        return most if self.loss_tokens is None else min(int(self.loss_tokens), most)


@dataclass
class Prediction:
    shape: Shape
    peak_bytes: int
    by_category: dict[str, int]
    base_bytes: int
    phase: str
    op: str
    seconds: float
    ops: int
    assumptions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepFunctions:
    """The harness's own functions the step calls (the reference harness's where it has none,
    as the profile does: probes.step.harness)."""

    discover_target_modules: Callable[[torch.nn.Module], list[str]]
    compute_loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    apply_adapters: Callable[[torch.nn.Module, list[str]], torch.nn.Module] | None = None
    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None


def functions_of(harness: Any) -> StepFunctions:
    """From a `probes.step.harness.Harness` or a plain module."""
    from probes.step import reference_harness

    hook = getattr(harness, "hook", None)

    def optional(name: str) -> Any:
        found = hook(name) if callable(hook) else getattr(harness, name, None)
        return found or getattr(reference_harness, name)

    return StepFunctions(
        discover_target_modules=harness.discover_target_modules,
        compute_loss=harness.compute_loss,
        apply_adapters=optional("apply_adapters"),
        build_optimizer=optional("build_optimizer"),
    )


@dataclass
class FakeStep:
    """The model (fake tensors), its optimizer and the harness: built once, stepped per shape."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    harness: StepFunctions
    mode: FakeTensorMode
    round_to: int
    grad_accum: int
    build_seconds: float
    notes: list[str] = field(default_factory=list)


def materialise_fake(
    model: torch.nn.Module, mode: FakeTensorMode, device: str | torch.device = "cpu"
) -> None:
    """Replace every parameter/buffer (meta or real) by a fake tensor on `device`, keeping
    shared ones shared."""
    memo: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in memo:
                    fake = torch.empty(param.shape, dtype=param.dtype, device=device)
                    memo[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                module._parameters[name] = memo[id(param)]
            for name, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                if id(buf) not in memo:
                    memo[id(buf)] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                module._buffers[name] = memo[id(buf)]


def build_fake_step(
    config: Any,
    harness: StepFunctions,
    dtype: str,
    grad_accum: int = 1,
    round_to: int = 1,
    model: torch.nn.Module | None = None,
    attn_implementation: str = "sdpa",
) -> FakeStep:
    """Build the model from a transformers config (or take a meta `model`), adapt, optimise."""
    if dtype not in DTYPES:
        raise PredictError(
            f"mask.dtype (the training dtype): {dtype!r} is not one of {sorted(DTYPES)}"
        )
    start = time.perf_counter()
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
            )
    targets = harness.discover_target_modules(model)
    if harness.apply_adapters is not None:
        with torch.device("meta"):  # the adapters' own init would run on real CPU tensors
            model = harness.apply_adapters(model, targets)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    materialise_fake(model, mode)
    model.train()
    with mode:
        optimizer = _build_optimizer(model, harness)
        notes = foreach_as_on_gpu(optimizer) if round_to > 1 else []
        warm_optimizer(model, optimizer)
    seconds = time.perf_counter() - start
    return FakeStep(model, optimizer, harness, mode, round_to, grad_accum, seconds, notes)


def foreach_as_on_gpu(optimizer: torch.optim.Optimizer) -> list[str]:
    """Where the optimizer leaves `foreach` to torch (None), torch picks the foreach path for
    CUDA parameters: the fake CPU step does the same, so its temporaries are the GPU's."""
    changed = 0
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = True
            changed += 1
    if not changed:
        return []
    return [f"{type(optimizer).__name__}: foreach=True, torch's default for CUDA parameters"]


def _build_optimizer(model: torch.nn.Module, harness: StepFunctions) -> torch.optim.Optimizer:
    if harness.build_optimizer is not None:
        return harness.build_optimizer(model)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def warm_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients, so the optimizer's states exist as they do from step 2 on."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_batch(shape: Shape, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The harness's batch at `shape` (values irrelevant on fake tensors: zeros)."""
    if shape.layout == PACKED:
        ids = torch.zeros(1, shape.length, dtype=torch.long, device=device)
        return {
            "input_ids": ids,
            "position_ids": torch.zeros(1, shape.length, dtype=torch.long, device=device),
            "labels": torch.zeros(1, shape.length, dtype=torch.long, device=device),
        }
    ids = torch.zeros(shape.rows, shape.length, dtype=torch.long, device=device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.zeros_like(ids),
    }


def traced_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compute_loss: Any,
    batch: dict[str, torch.Tensor],
    tracker: StepTracker,
    grad_accum: int = 1,
) -> dict[str, Any]:
    """Forward + loss, backward, optimizer step under `tracker`; returns the peak's fields."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if grad_accum > 1:  # the earlier micro-batches of this optimizer step left their gradients
        for param in trainable:
            param.grad = torch.zeros_like(param)
    tracker.track(params)
    tracker.track(model.buffers())
    tracker.track(v for state in optimizer.state.values() for v in state.values())
    tracker.track(p.grad for p in trainable if p.grad is not None)
    tracker.track(batch.values())
    with tracker:
        tracker.phase(FORWARD)
        loss = compute_loss(model, batch)
        tracker.phase(BACKWARD)
        loss.backward()
        tracker.phase(OPTIMIZER_STEP)
        optimizer.step()
    grads = [p.grad for p in trainable if p.grad is not None]
    peak = tracker.peak(categories_for(tracker, params, optimizer, grads))
    optimizer.zero_grad(set_to_none=True)
    return {
        "peak_bytes": peak.total,
        "by_category": peak.by_category,
        "base_bytes": peak.base,
        "phase": peak.phase,
        "op": peak.op,
        "ops": peak.ops,
    }


def predict(step: FakeStep, shape: Shape) -> Prediction:
    """The peak of one training step at `shape` on fake tensors."""
    start = time.perf_counter()
    tracker = StepTracker(round_to=step.round_to, true_count=shape.loss_positions())
    try:
        with fake_errors(shape), step.mode:
            batch = make_batch(shape)
            fields = traced_step(
                step.model,
                step.optimizer,
                step.harness.compute_loss,
                batch,
                tracker,
                step.grad_accum,
            )
    finally:
        step.optimizer.zero_grad(set_to_none=True)
    return Prediction(
        shape=shape,
        peak_bytes=int(fields["peak_bytes"]),
        by_category={c: int(fields["by_category"][c]) for c in CATEGORIES},
        base_bytes=int(fields["base_bytes"]),
        phase=str(fields["phase"]),
        op=str(fields["op"]),
        seconds=time.perf_counter() - start,
        ops=int(fields["ops"]),
        assumptions=step_assumptions(step.notes, tracker, shape),
    )


@contextmanager
def fake_errors(shape: Shape) -> Iterator[None]:
    """What fake tensors cannot follow, as a PredictError naming the shape and the op."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise PredictError(
            f"shape {shape.name}: fake tensors cannot follow a data-dependent op "
            f"({error.func}) in the model or harness; no assumption is built in for it"
        ) from error
    except RuntimeError as error:  # an op with no fake (meta) kernel for these inputs
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise PredictError(
            f"shape {shape.name}: an op cannot run on fake tensors ({type(error).__name__}: "
            f"{first})"
        ) from error


def step_assumptions(notes: list[str], tracker: StepTracker, shape: Shape) -> list[str]:
    """What the figure assumed where fake tensors could not know: said beside it."""
    assumptions = list(notes)
    if tracker.bool_index_calls:
        assumptions.append(
            f"boolean indexing answered with {shape.loss_positions()} loss positions"
        )
    if tracker.scalar_reads:
        assumptions.append(
            f"{tracker.scalar_reads} host read(s) of a scalar (metrics' .item(), the NaN/inf "
            "check) answered 0: they steer logging, not the step's tensors"
        )
    if any("scaled_dot_product" in op for op in tracker.sdpa_ops):
        assumptions.append("attention: fused SDPA (O(T) memory per head), as flash/cuDNN")
    if any("grouped_mm" in op for op in tracker.sdpa_ops):
        assumptions.append(
            "MoE experts as grouped matmuls over tokens x top-k rows: memory independent of "
            "the routing (any routing, balanced included, gives this figure)"
        )
    return assumptions


class CachedPredictor:
    """One prediction per distinct (step setting, rows, length, layout, loss positions)."""

    def __init__(self, step: Any, predict_fn: Any = predict) -> None:
        self.step = step
        self.predict_fn = predict_fn
        self.cache: dict[tuple, Prediction | PredictError] = {}
        self.count = 0
        self.setting: tuple = ()  # a step-level change set on the step (step_changes.configured)

    def made_since(self, keys: set[tuple]) -> dict[tuple, Prediction]:
        """Its predictions whose keys are not in `keys` (its cache's keys at an earlier time)."""
        return {
            key: found
            for key, found in self.cache.items()
            if key not in keys and isinstance(found, Prediction)
        }

    def absorb(self, made: Mapping[tuple, Prediction]) -> None:
        """Predictions a copy of this predictor made (a forked child's), cached and counted
        here as if made here: one it has made too is counted once."""
        for key, found in made.items():
            if key not in self.cache:
                self.cache[key] = found
                self.count += 1

    def __call__(self, shape: Shape) -> Prediction:
        key = (self.setting, shape.rows, shape.length, shape.layout, shape.loss_positions())
        if key not in self.cache:
            try:
                self.cache[key] = self.predict_fn(self.step, shape)
                self.count += 1
            except PredictError as error:
                self.cache[key] = error
        found = self.cache[key]
        if isinstance(found, PredictError):
            raise found
        return found
