"""Live tensor bytes over one training step, op by op, split into categories at the peak.

`StepTracker` is a TorchDispatchMode: every tensor an ATen op returns has its storage counted
once, when the op creates it, and uncounted when the storage is freed (a weakref finaliser). It
works the same on fake tensors (FakeTensorMode: no data, no device) and on real ones, so the
prediction and a real CPU step go through one code path; the real-step check
(`probes.memory.real`) uses a different instrument, the profiler's allocator events.

Why not torch's MemTracker: it registers a gradient hook on every parameter and raises on frozen
ones (every LoRA base weight), and its module hooks made a whole-model trace of Gemma 3 27B take
~3 min. This tracker hooks no module; the category of each storage is decided after the step by
identity: the parameters, `.grad` of the trainable ones, the optimizer's state, else an
activation or temporary (the batch included).

Data-dependent shapes: fake tensors cannot know how many labels are -100. A boolean index (the
reference harness's `hidden[labels != -100]`) is answered with `true_count` rows, the shape's
loss positions, and the figure says so. Data-dependent scalars: a trainer reads a few on the host
every step (`.item()` of its metrics, the NaN/inf check); with `answer_scalars` each read of a fake
tensor is answered 0 (False) and counted, so the step runs on; the prediction says how many.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
)
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS)
FORWARD, BACKWARD, OPTIMIZER_STEP, SETUP = "forward", "backward", "optimizer", "setup"
# Ops whose kernel allocates tensors it never returns, so no dispatch mode sees them: op name ->
# (multiple of the first input's bytes, multiple of the output's bytes), live beside the output.
# Measured with the profiler's allocator events on CPU (tests/unit/memory); ATen's logsumexp is
# device-generic (the max at the output's size, then exp(self - max) at the input's size), so a
# GPU holds the same. Under the chunked loss that is one [chunk, vocab] float32 block: 1 GiB at
# 1,024 tokens x 262k vocabulary.
HIDDEN_TEMPORARIES = {"logsumexp.default": (1.0, 1.0)}


@dataclass
class Peak:
    """The peak of one step: total bytes, bytes per category, the phase and op it happened in."""

    total: int
    by_category: dict[str, int]
    phase: str
    op: str
    base: int  # bytes live before the step began (parameters, optimizer state, batch)
    ops: int  # ATen ops seen
    notes: list[str] = field(default_factory=list)


class StepTracker(TorchDispatchMode):
    """Count storage bytes created by every op; `peak()` splits the highest point by category.

    `round_to` rounds each storage up as an allocator does (512 for the CUDA caching allocator;
    1 for the CPU check). `true_count` answers boolean indexing on fake tensors;
    `answer_scalars` answers a host read of a fake scalar with 0 (`scalar_reads` counts them).
    """

    def __init__(
        self, round_to: int = 1, true_count: int | None = None, answer_scalars: bool = False
    ) -> None:
        super().__init__()
        self.round_to = max(int(round_to), 1)
        self.true_count = true_count
        self.answer_scalars = answer_scalars
        self.scalar_reads = 0
        self._serial = itertools.count(1)
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._bytes: dict[int, int] = {}
        self._events: list[tuple[int, int]] = []  # (+serial alloc | -serial free, live after)
        self._op_of: dict[int, str] = {}
        self._shape_of: dict[int, tuple[tuple[int, ...], str]] = {}  # kept where keep_shapes
        self.keep_shapes = False
        self._phase_at: list[tuple[int, str]] = [(0, SETUP)]
        self.live = 0
        self.ops = 0
        self.bool_index_calls = 0
        self.sdpa_ops: dict[str, int] = {}  # attention and grouped (MoE expert) matmuls

    # -- counting ------------------------------------------------------------------------------

    def track(self, tensors: Iterable[Any], op: str = "before the step") -> None:
        """Count the storages of `tensors` (existing ones: parameters, states, the batch)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, op)

    def _track(self, tensor: torch.Tensor, op: str) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return  # a tensor without storage (a sparse or nested layout): nothing to count
        if storage in self._known:
            return
        serial = next(self._serial)
        nbytes = -(-storage.nbytes() // self.round_to) * self.round_to
        self._known[storage] = serial
        self._bytes[serial] = nbytes
        self._op_of[serial] = op
        if self.keep_shapes:
            self._shape_of[serial] = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
        self.live += nbytes
        self._events.append((serial, self.live))
        weakref.finalize(storage, self._free, serial)

    def _free(self, serial: int) -> None:
        self.live -= self._bytes[serial]
        self._events.append((-serial, self.live))

    def serial_of(self, tensor: torch.Tensor) -> int | None:
        return self._known.get(tensor.untyped_storage())

    def phase(self, name: str) -> None:
        """Mark where the step is (forward, backward, optimizer) for the peak's phase."""
        self._phase_at.append((len(self._events), name))

    # -- dispatch ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.answer_scalars and func is torch.ops.aten._local_scalar_dense.default:
            if isinstance(args[0], FakeTensor):  # a metric's .item(), a NaN check's bool()
                self.scalar_reads += 1
                return _zero_of(args[0].dtype)
        if func is torch.ops.aten.index.Tensor and self.true_count is not None:
            args = self._bool_index_as_rows(args)
        name = func.__name__
        out = func(*args, **kwargs)
        self.ops += 1
        if "scaled_dot_product" in name or "grouped_mm" in name:
            self.sdpa_ops[name] = self.sdpa_ops.get(name, 0) + 1
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, name)
        hidden = self._hidden_temporary(name, args, out)
        if hidden is not None:
            self._free(hidden)
        return out

    def _hidden_temporary(self, name: str, args: tuple, out: Any) -> int | None:
        """Count the kernel's own temporaries beside its output (HIDDEN_TEMPORARIES)."""
        factors = HIDDEN_TEMPORARIES.get(name)
        if factors is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        source = args[0]
        result = out if isinstance(out, torch.Tensor) else source.new_empty(0)
        nbytes = int(
            factors[0] * source.numel() * source.element_size()
            + factors[1] * result.numel() * result.element_size()
        )
        nbytes = -(-nbytes // self.round_to) * self.round_to
        serial = next(self._serial)
        self._bytes[serial] = nbytes
        self._op_of[serial] = f"{name} (kernel temporary)"
        self.live += nbytes
        self._events.append((serial, self.live))
        return serial

    def _bool_index_as_rows(self, args: tuple) -> tuple:
        source, indices = args[0], args[1]
        if not any(i is not None and i.dtype == torch.bool for i in indices):
            return args
        self.bool_index_calls += 1
        rows = []
        for index in indices:
            if index is not None and index.dtype == torch.bool:
                count = min(int(self.true_count), index.numel())
                row = torch.zeros(count, dtype=torch.long, device=index.device)
                rows.extend([row] * index.dim())
            else:
                rows.append(index)
        return (source, rows, *args[2:])

    # -- the peak ------------------------------------------------------------------------------

    def _peak_index(self) -> int:
        return max(range(len(self._events)), key=lambda i: self._events[i][1])

    def _live_after(self, index: int) -> set[int]:
        live: set[int] = set()
        for serial, _ in self._events[: index + 1]:
            if serial > 0:
                live.add(serial)
            else:
                live.discard(-serial)
        return live

    def live_at_peak(self) -> list[dict[str, Any]]:
        """Every storage live at the peak: serial, bytes, the op that made it and (where
        `keep_shapes` was set before the step) its shape and dtype. For dissecting a figure."""
        if not self._events:
            return []
        out = []
        for serial in sorted(self._live_after(self._peak_index())):
            shape, dtype = self._shape_of.get(serial, ((), ""))
            op = self._op_of.get(serial, "")
            out.append(
                dict(serial=serial, bytes=self._bytes[serial], op=op, shape=shape, dtype=dtype)
            )
        return out

    def peak(self, categories: dict[int, str] | None = None) -> Peak:
        """The highest live total over the events, split by `categories` (serial -> category)."""
        categories = categories or {}
        if not self._events:
            return Peak(0, dict.fromkeys(CATEGORIES, 0), SETUP, "", 0, self.ops)
        index = self._peak_index()
        live = self._live_after(index)
        split = dict.fromkeys(CATEGORIES, 0)
        for serial in live:
            split[categories.get(serial, ACTIVATIONS)] += self._bytes[serial]
        phase = SETUP
        for start, name in self._phase_at:
            if start <= index:
                phase = name
        serial = self._events[index][0]
        base = self._events[self._first_step_event() - 1][1] if self._first_step_event() else 0
        return Peak(
            total=self._events[index][1],
            by_category=split,
            phase=phase,
            op=self._op_of.get(abs(serial), ""),
            base=base,
            ops=self.ops,
        )

    def _first_step_event(self) -> int:
        return self._phase_at[1][0] if len(self._phase_at) > 1 else 0


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else 0


def categories_for(
    tracker: StepTracker,
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    grads: Iterable[torch.Tensor] = (),
) -> dict[int, str]:
    """serial -> category for the parameters, their gradients and the optimizer state."""
    out: dict[int, str] = {}

    def mark(tensor: Any, category: str) -> None:
        if isinstance(tensor, torch.Tensor):
            serial = tracker.serial_of(tensor)
            if serial is not None:
                out.setdefault(serial, category)

    for tensor in parameters:
        mark(tensor, PARAMETERS)
    for tensor in grads:
        mark(tensor, GRADIENTS)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                mark(value, OPTIMIZER)
    return out
