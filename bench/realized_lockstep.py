"""Realized epochs in lockstep: every configuration's trainer in its own process, the processes
taking turns one optimizer step at a time, so the machine's drift (another job, a clock change)
falls on every configuration alike instead of on whichever epoch ran through it.

Each configuration's epoch time is the sum of its own turns (from the turn's start to its
``on_step_end``), measured inside its process; only one process runs at a time, so they never
compete for the cores. The next turn goes to the configuration furthest behind in its epoch
(optimizer steps done over its epoch's steps), so a 10-step packed epoch and a 25-step baseline
interleave over the same stretch of time. Processes are forked (CPU only: a CUDA context does not
survive a fork); the parent's imports and warm-up carry over.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

# builds one configuration's trainer; contexts it needs for the epoch (an output directory, empty
# compile caches) go on the stack, closed after the epoch
Build = Callable[[contextlib.ExitStack], Any]

GO, STOP = "go", "stop"


def turn_callback(conn: Any) -> Any:
    """A TrainerCallback that hands the turn back to the coordinator at every optimizer step
    and times only the trainer's own turns."""
    from transformers import TrainerCallback

    class Turns(TrainerCallback):
        def __init__(self) -> None:
            self.elapsed = 0.0
            self.started = 0.0

        def _wait(self) -> None:
            if conn.recv() != GO:
                raise SystemExit(0)  # the coordinator stopped the round
            self.started = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            conn.send(("ready", 0.0))
            self._wait()

        def on_step_end(self, args, state, control, **kwargs):
            self.elapsed += time.perf_counter() - self.started
            conn.send(("step", state.global_step / max(state.max_steps, 1)))
            self._wait()

        def on_train_end(self, args, state, control, **kwargs):
            self.elapsed += time.perf_counter() - self.started

    return Turns()


def _child(conn: Any, build: Build) -> None:
    try:
        with contextlib.ExitStack() as stack:
            trainer = build(stack)
            turns = turn_callback(conn)
            trainer.add_callback(turns)
            trainer.train()
            steps = trainer.state.global_step
        conn.send(("done", {"train_runtime": turns.elapsed, "optimizer_steps": steps}))
    except SystemExit:  # stopped by the coordinator: nothing to report
        pass
    except BaseException as error:  # the coordinator names it; the child only reports
        conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


def next_turn(progress: dict[int, float]) -> int:
    """The configuration furthest behind in its epoch (the first of equals)."""
    return min(progress, key=lambda i: (progress[i], i))


def lockstep_round(builds: list[tuple[str, Build]]) -> list[dict[str, float]]:
    """One epoch of every trainer `builds` makes ((name, build) pairs), interleaved step by
    step; the results in the builds' order ({"train_runtime": own seconds, "optimizer_steps"})."""
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for _, build in builds:
        parent, child = ctx.Pipe()
        # not a daemon: a configuration with dataloader workers starts processes of its own
        proc = ctx.Process(target=_child, args=(child, build))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        return _coordinate(pipes, [name for name, _ in builds])
    finally:
        for pipe in pipes:  # a child still waiting for its turn (after another one failed) stops
            with contextlib.suppress(OSError):
                pipe.send(STOP)
            pipe.close()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _coordinate(pipes: list[Any], names: list[str]) -> list[dict[str, float]]:
    results: dict[int, dict[str, float]] = {}
    progress: dict[int, float] = {}
    for i, pipe in enumerate(pipes):  # every trainer built (in parallel, untimed) and waiting
        kind, value = pipe.recv()
        if kind != "ready":
            raise RuntimeError(f"{names[i]}: failed before its epoch: {value}")
        progress[i] = 0.0
    while progress:
        i = next_turn(progress)
        pipes[i].send(GO)
        kind, value = pipes[i].recv()
        if kind == "step":
            progress[i] = float(value)
        elif kind == "done":
            results[i] = value
            del progress[i]
        else:
            raise RuntimeError(f"{names[i]}: failed in its epoch: {value}")
    return [results[i] for i in range(len(pipes))]


def lockstep_rounds(
    configs: list[tuple[str, Any]],
    build: Callable[[str, Any, contextlib.ExitStack], Any],
    repeats: int,
    first_round: int = 0,
) -> dict[str, list[dict[str, float]]]:
    """`repeats` lockstep rounds of one epoch of every configuration: {name: [result per round]}
    (the shape realized_epochs.rounds returns), each result with its "round" (from
    `first_round`), which pairs a change's epoch with the baseline's of the same round."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    for repeat in range(first_round, first_round + repeats):
        builds = [
            (name, lambda stack, name=name, what=what: build(name, what, stack))
            for name, what in configs
        ]
        for (name, _), result in zip(configs, lockstep_round(builds), strict=True):
            runs[name].append({**result, "round": repeat})
            print(
                f"  round {repeat + 1} {name:<26s} "
                f"{result['train_runtime']:7.2f} s, {result['optimizer_steps']} steps (lockstep)",
                flush=True,
            )
    return runs


def rounds_until_narrow(
    configs: list[tuple[str, Any]],
    build: Callable[[str, Any, contextlib.ExitStack], Any],
    repeats: int,
    too_wide: Callable[[dict[str, list[dict[str, float]]]], list[str]],
    extra_rounds: int,
) -> dict[str, list[dict[str, float]]]:
    """`repeats` lockstep rounds of every configuration, then up to `extra_rounds` more of the
    first (the baseline) and the configurations `too_wide` still names (their realized interval
    too wide to tell a miss), so more timing goes where the verdict is still open."""
    runs = lockstep_rounds(configs, build, repeats)
    for extra in range(extra_rounds):
        wide = set(too_wide(runs))
        if not wide:
            break
        again = [configs[0]] + [c for c in configs[1:] if c[0] in wide]
        print(f"  extra round {extra + 1}/{extra_rounds}: {', '.join(sorted(wide))}", flush=True)
        for name, results in lockstep_rounds(again, build, 1, repeats + extra).items():
            runs[name] += results
    return runs
