"""The peak of one step of the user's own trainer (`trainer.factory`), on fake tensors.

The trainer is the one the factory built (`probes.step.trainer.TrainerStep`). For the prediction
its model's parameters and buffers are swapped for fake tensors of the same shapes, dtypes and
device (`fake_trainer`), the trainer builds its own optimizer and scheduler over them
(`create_optimizer_and_scheduler`: the user's optimizer choice, weight-decay groups and all), and
one warm step on zero gradients gives the optimizer its states. Then the TrainerStep's own `step`
runs under `StepTracker`: `training_step` (its `_prepare_inputs`, its `compute_loss` with what it
computes beside the loss, backward through its accelerator), the loop's NaN/inf check and FLOP
count, gradient clipping, the optimizer and scheduler step, `zero_grad`. On leaving, the real
parameters, optimizer and scheduler are put back untouched.

What fake tensors cannot follow, assumed and stated in the prediction: a host read of a scalar
(TRL's entropy and accuracy `.item()`, the NaN/inf check) is answered 0, as it steers logging and
not the step's tensors; a boolean index gets the shape's loss positions. The trace runs on the
model's own device type, so device-dependent paths (TRL's fused LM head scores only the loss
positions on Triton devices, every position elsewhere) follow the device the trainer is on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from probes.memory.predict import (
    Prediction,
    Shape,
    fake_errors,
    make_batch,
    materialise_fake,
    step_assumptions,
    warm_optimizer,
)
from probes.memory.tracker import (
    CATEGORIES,
    GRADIENTS,
    OPTIMIZER_STEP,
    StepTracker,
    categories_for,
)
from probes.step.trainer import SCHEDULE_STEPS  # the real scheduler's length

# the trainer's training_step runs forward and backward in one call: one phase for both
TRAINING_STEP = "training_step"
PHASE_OF_MARK = {"built": TRAINING_STEP, "micro_batch": OPTIMIZER_STEP, "optimizer": OPTIMIZER_STEP}


@dataclass
class FakeTrainer:
    """A TrainerStep whose model holds fake tensors, and the mode they belong to."""

    step: Any  # probes.step.trainer.TrainerStep
    mode: FakeTensorMode
    device: torch.device
    round_to: int
    build_seconds: float


@contextmanager
def fake_trainer(step: Any, round_to: int = 1) -> Iterator[FakeTrainer]:
    """`step`'s trainer on fake tensors while inside; its real tensors and optimizer after."""
    model, trainer = step.model, step.trainer
    device = next(model.parameters()).device
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    kept = (trainer.optimizer, trainer.lr_scheduler, step.optimizer)
    start = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    materialise_fake(model, mode, device)
    try:
        with mode:
            trainer.optimizer = trainer.lr_scheduler = None
            trainer.create_optimizer_and_scheduler(num_training_steps=SCHEDULE_STEPS)
            step.optimizer = trainer.optimizer
            warm_optimizer(model, step.optimizer)
        yield FakeTrainer(step, mode, device, round_to, time.perf_counter() - start)
    finally:
        model.zero_grad(set_to_none=True)
        for module, parameters, buffers in saved:
            module._parameters.update(parameters)
            module._buffers.update(buffers)
        trainer.optimizer, trainer.lr_scheduler, step.optimizer = kept


def predict_trainer(fake: FakeTrainer, shape: Shape) -> Prediction:
    """The peak of the trainer's step on one micro-batch at `shape` (its first micro-batch of
    an optimizer step: no earlier gradients live), split by category."""
    start = time.perf_counter()
    step, model = fake.step, fake.step.model
    tracker = StepTracker(fake.round_to, shape.loss_positions(), answer_scalars=True)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    grads: list[int] = []

    def mark(phase: str) -> None:
        if phase == "micro_batch":  # the gradients, known by identity before zero_grad frees them
            found = (tracker.serial_of(p.grad) for p in trainable if p.grad is not None)
            grads.extend(serial for serial in found if serial is not None)
        tracker.phase(PHASE_OF_MARK[phase])

    with fake_errors(shape), fake.mode:
        batch = make_batch(shape, fake.device)
        tracker.track(params)
        tracker.track(model.buffers())
        tracker.track(v for state in step.optimizer.state.values() for v in state.values())
        tracker.track(batch.values())
        with tracker:
            step.step([batch], mark)
        categories = categories_for(tracker, params, step.optimizer)
    categories.update(dict.fromkeys(grads, GRADIENTS))
    peak = tracker.peak(categories)
    return Prediction(
        shape=shape,
        peak_bytes=int(peak.total),
        by_category={c: int(peak.by_category[c]) for c in CATEGORIES},
        base_bytes=int(peak.base),
        phase=peak.phase,
        op=peak.op,
        seconds=time.perf_counter() - start,
        ops=int(peak.ops),
        assumptions=step_assumptions([], tracker, shape),
    )
