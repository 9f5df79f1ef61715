"""The real peak of one training step, measured by an instrument other than the predictor's.

On a GPU: `torch.cuda.max_memory_allocated` over the step (after `reset_peak_memory_stats`). On
CPU: the profiler's allocator events (`profile_memory=True`): every allocation and free of the
step in time order, summed; the peak of that running sum plus the bytes live before the step.

`measure_step_peak` is the hook the profile stage calls on each timed step's model, optimizer and
batch: it runs the same sequence as the prediction (`probes.memory.predict.traced_step`): forward
with the harness's loss, backward, optimizer step, `zero_grad(set_to_none=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def live_before_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, Any]
) -> int:
    """Parameters, buffers, optimizer state, existing gradients and the batch."""
    tensors: list[Any] = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    tensors += list(batch.values())
    return storage_bytes(tensors)


def run_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compute_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Mapping[str, Any],
) -> None:
    loss = compute_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cpu_allocator_peak(step: Callable[[], None]) -> int:
    """Peak of the running sum of the profiler's CPU allocator events over `step()`, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda item: item[0])
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def measure_step_peak(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compute_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Mapping[str, Any],
) -> dict[str, Any]:
    """The real peak bytes of one step and the instrument that measured it."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(model, optimizer, compute_loss, batch)
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
        return {"peak_bytes": peak, "instrument": "torch.cuda.max_memory_allocated"}
    base = live_before_step(model, optimizer, batch)
    above = cpu_allocator_peak(lambda: run_step(model, optimizer, compute_loss, batch))
    return {
        "peak_bytes": base + above,
        "base_bytes": base,
        "instrument": "torch.profiler allocator events (profile_memory=True) + live tensors",
    }
