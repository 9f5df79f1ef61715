"""Realize's timing: one whole optimizer step as training runs it, with its phases.

A step is ``StepRunner.step`` (probes.step.runner), the same call the profile times: each of
its ``grad_accum`` micro-batches in the plan's order is built (the plan's real shapes, padding
side, packing boundaries and loss tokens; random token ids), moved to the device, run through
the harness's ``compute_loss`` and backward; then the harness's optimizer step and zero_grad.
Nothing is re-warmed between steps: the model, optimizer state and allocator carry over.

The step is timed as a whole (host wall between device synchronisations); its phases come from a
clock marked inside the step (perf_counter on CPU, CUDA events on a GPU, so no synchronisation is
added): micro-batches (forward + backward), optimizer (step + zero_grad), and the rest (the wall
minus both: building and moving the batches, and what lies between).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from probes.step.timing import OK, OOM, is_out_of_memory, release_memory, synchronize

# the phase a clock segment belongs to, by the mark that ends it (StepRunner.step's marks)
SEGMENT_PHASE = {"built": "rest", "micro_batch": "micro_batch", "optimizer": "optimizer"}


def phase_durations(marks: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Seconds per phase from (mark, time) pairs in order: each segment goes to the phase of the
    mark that ends it (SEGMENT_PHASE); the first mark is the start."""
    totals = {"micro_batch": 0.0, "optimizer": 0.0, "rest": 0.0}
    for (_, begin), (name, end) in zip(marks, marks[1:], strict=False):
        totals[SEGMENT_PHASE.get(name, "rest")] += end - begin
    return totals


class PhaseClock:
    """Marks inside a step: perf_counter on CPU, CUDA events (no synchronisation) on a GPU."""

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, self.clock()))

    def read(self) -> list[tuple[str, float]]:
        """(mark, seconds since the first mark); on CUDA call after a synchronisation."""
        if not self.marks:
            return []
        if self.cuda:
            first = self.marks[0][1]
            return [(n, first.elapsed_time(e) / 1e3) for n, e in self.marks]
        first = self.marks[0][1]
        return [(n, t - first) for n, t in self.marks]


class StepTimer:
    """Times whole optimizer steps of plan rows through a StepRunner (`clock`: the host clock;
    a test's synthetic harness may bring a virtual one)."""

    def __init__(
        self,
        runner: Any,
        vocab_size: int,
        pad_id: int,
        seed: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.clock = clock
        self.device = runner.device
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.generator = torch.Generator().manual_seed(seed)
        self.switch: Any = None  # probes.step.changes.StepSwitch where step changes are realized

    def batches(self, rows: Sequence[Any]) -> Iterator[dict[str, torch.Tensor]]:
        for row in rows:
            yield self.runner.plan_batch(row, self.vocab_size, self.generator, self.pad_id)

    def run(self, rows: Sequence[Any], mark: Callable[[str], None] | None = None) -> None:
        self.configure(rows)
        self.runner.step(self.batches(rows), mark)

    def configure(self, rows: Sequence[Any]) -> None:
        """The step as the rows' strategy runs it (a step-level change's setting, else the
        base's)."""
        if self.switch is not None and rows:
            self.switch.set(getattr(rows[0], "strategy", None))

    def time_step(self, rows: Sequence[Any]) -> dict[str, Any]:
        """One whole step of `rows` (its micro-batches, in order): wall time and phases."""
        clock = PhaseClock(self.device, self.clock)
        try:
            synchronize(self.device)
            if hasattr(self.runner, "run_rows"):
                self.configure(rows)
                # the trainer's own loop: it marks its step's bounds (the first fetch, then
                # its callbacks), so the loop's set-up around the step is not timed
                self.runner.run_rows(rows, clock.mark)
                synchronize(self.device)
                wall = clock.read()[-1][1]
            else:
                begin = self.clock()
                clock.mark("start")
                self.run(rows, clock.mark)
                synchronize(self.device)
                wall = self.clock() - begin
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self.runner.zero_grad()  # partial gradients
            release_memory(self.device)
            nan = float("nan")
            return {
                "status": OOM,
                "time_s": nan,
                "micro_batch_s": nan,
                "optimizer_s": nan,
                "rest_s": nan,
            }
        phases = phase_durations(clock.read())
        return {
            "status": OK,
            "time_s": wall,
            "micro_batch_s": phases["micro_batch"],
            "optimizer_s": phases["optimizer"],
            "rest_s": wall - phases["micro_batch"] - phases["optimizer"],
        }
