"""The real peak of one training step, measured by an instrument other than the predictor's.

On a GPU: `torch.cuda.max_memory_allocated` over the step (after `reset_peak_memory_stats`). On
CPU: the profiler's allocator events (`profile_memory=True`): every allocation and free of the
step in time order, summed; the peak of that running sum plus the bytes live before the step.

`measure_step_peak` runs a harness's step as the prediction does (`probes.memory.predict.
traced_step`): forward with the harness's loss, backward, optimizer step,
`zero_grad(set_to_none=True)`. `measure_peak` measures any step given as a function: the profile
gives it its own runner's step (the harness's, or the user's trainer's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
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
    """The real peak bytes of one harness step and the instrument that measured it."""
    return measure_peak(
        model, optimizer, batch, lambda: run_step(model, optimizer, compute_loss, batch)
    )


def measure_peak(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Any],
    step: Callable[[], None],
) -> dict[str, Any]:
    """The real peak bytes of `step()` (one training step of `model`, `optimizer` on `batch`,
    e.g. a trainer's own), and the instrument that measured it."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
        return {"peak_bytes": peak, "instrument": "torch.cuda.max_memory_allocated"}
    base = live_before_step(model, optimizer, batch)
    above = cpu_allocator_peak(step)
    return {
        "peak_bytes": base + above,
        "base_bytes": base,
        "instrument": "torch.profiler allocator events (profile_memory=True) + live tensors",
    }


def scaling_step_peaks(
    runner: Any, batch_of: Callable[[int], Mapping[str, Any]], lengths: Iterable[int]
) -> dict[Any, int]:
    """Shape -> the real peak bytes of one step of `runner` (a StepRunner or TrainerStep: its
    `step`, `model`, `optimizer`) on `batch_of(length)`, at the batch's rows, length and loss
    positions (the positions whose hidden state predicts a labelled token)."""
    from probes.memory.predict import Shape
    from probes.step.batches import loss_position_count

    real = {}
    for length in lengths:
        batch = batch_of(int(length))
        rows = int(batch["input_ids"].shape[0])
        shape = Shape(
            f"{rows}x{length}", rows, int(length), loss_tokens=loss_position_count(batch["labels"])
        )
        peak = measure_peak(runner.model, runner.optimizer, batch, partial(runner.step, [batch]))
        real[shape] = int(peak["peak_bytes"])
        del batch  # the next point's batch is made without this one live
    return real
