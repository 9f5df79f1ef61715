"""The data-parallel step, predicted and decomposed (pure functions over measured seconds).

A DDP optimizer step with gradient accumulation (``no_sync`` on all but the last micro-batch)
meets at one gradient all-reduce, so its time is the slowest rank's micro-batch work, plus the
collective, plus the optimizer step. The **prediction** uses only one-process measurements (each
rank's micro-batches timed with no communication) and the measured collective:

    predicted step = max over ranks (Σ one-process micro-batch times) + optimizer + collective

The **decomposition** of a real step on a rank: its wait at the collective (until the slowest
rank's gradients are ready), the collective itself, and the rest (its compute).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def predict_step(rank_single_s: Sequence[float], optimizer_s: float, collective_s: float) -> float:
    """One step: the slowest rank's one-process micro-batch seconds + optimizer + collective."""
    if not rank_single_s:
        raise ValueError("predict_step needs at least one rank's time")
    return max(rank_single_s) + optimizer_s + collective_s


def predict_epoch(
    single_s: Sequence[Sequence[float]], optimizer_s: float, collective_s: float
) -> float:
    """Σ over steps of ``predict_step``; ``single_s[rank][step]`` (every rank the same steps)."""
    n_steps = {len(r) for r in single_s}
    if len(n_steps) != 1:
        raise ValueError(f"every rank needs the same number of steps, got {sorted(n_steps)}")
    return sum(
        predict_step([r[s] for r in single_s], optimizer_s, collective_s)
        for s in range(n_steps.pop())
    )


def decompose(step_s: float, wait_s: float, collective_s: float) -> dict[str, float]:
    """A rank's step split into compute / wait / collective (compute is the rest, never < 0)."""
    return {
        "compute_s": max(step_s - wait_s - collective_s, 0.0),
        "wait_s": wait_s,
        "collective_s": collective_s,
    }


def derive_wait(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """FSDP2's wait and communication, which no hook can time (its ranks meet at every
    layer's all-gather): per (strategy, round, step), each rank's residual is its step less its
    one-process work and its optimizer; the smallest residual over the ranks (the rank that
    waited least) is the step's communication, and each rank's wait is its residual above it.
    Records without a hooked wait (NaN) get both; the others are returned as they are."""

    def key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (r.get("sharding"), r["strategy"], int(r["round"]), int(r["step"]))

    residual: dict[tuple[Any, ...], float] = {}
    for r in steps:
        left = float(r["step_s"]) - float(r["single_s"]) - float(r["optimizer_s"])
        residual[key(r)] = min(residual.get(key(r), left), left)
    out = []
    for r in steps:
        if float(r["wait_s"]) == float(r["wait_s"]):  # measured by the DDP hook
            out.append(dict(r))
            continue
        floor = max(residual[key(r)], 0.0)
        left = float(r["step_s"]) - float(r["single_s"]) - float(r["optimizer_s"])
        out.append({**r, "collective_s": floor, "wait_s": max(left - floor, 0.0)})
    return out


def straggler_wait(rank_compute_s: Sequence[float]) -> list[float]:
    """What each rank would wait at the collective if the ranks started together: the slowest
    rank's compute minus its own (the straggler's own wait is 0)."""
    slowest = max(rank_compute_s)
    return [slowest - c for c in rank_compute_s]


def strategy_summary(
    steps: Sequence[Mapping[str, Any]], optimizer_s: float, tolerance: float
) -> dict[str, Any]:
    """Real against predicted, and the shares, of one strategy's measured steps.

    ``steps``: one record per (round, step, rank) with keys round, step, rank, step_s, wait_s,
    collective_s, single_s (Σ one-process micro-batch seconds of that rank's micro-batches). The
    real step time is the slowest rank's wall (all ranks start each step at a barrier)."""
    by_step: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for record in steps:
        by_step.setdefault((int(record["round"]), int(record["step"])), []).append(record)
    if not by_step:
        raise ValueError("strategy_summary: no steps")
    collective = statistics.mean(float(r["collective_s"]) for r in steps)
    real = sum(max(float(r["step_s"]) for r in rs) for rs in by_step.values())
    predicted = sum(
        predict_step([float(r["single_s"]) for r in rs], optimizer_s, collective)
        for rs in by_step.values()
    )
    wall = sum(float(r["step_s"]) for r in steps)
    wait = sum(float(r["wait_s"]) for r in steps)
    ratio = real / predicted if predicted > 0 else float("nan")
    return {
        "steps_measured": len(by_step),
        "real_s": real,
        "predicted_s": predicted,
        "ratio": ratio,
        "within_tolerance": bool(abs(ratio - 1.0) <= tolerance),
        "compute_s_per_step": statistics.mean(
            decompose(float(r["step_s"]), float(r["wait_s"]), float(r["collective_s"]))["compute_s"]
            for r in steps
        ),
        "wait_s_per_step": wait / len(steps),
        "collective_s_per_step": collective,
        "optimizer_s": optimizer_s,
        # share of the ranks' step time spent in the all-reduce, and waiting for the slowest rank
        "communication_share": sum(float(r["collective_s"]) for r in steps) / wall if wall else 0.0,
        "straggler_wait_share": wait / wall if wall else 0.0,
    }


def saving(random_s: float, other_s: float) -> float:
    """Share of random's time a strategy saves (positive: faster)."""
    return 1.0 - other_s / random_s if random_s > 0 else float("nan")


def failed_rank_message(
    errors: Sequence[tuple[int, str]], returncode: int, launcher_tail: str, world_size: int
) -> str:
    """One message for a failed launch. ``errors``: (rank, traceback) in the order the ranks
    failed; the first is the cause (the others typically lost their peer at a collective). Without
    any, the launcher's last line."""
    if errors:
        rank, text = errors[0]
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else "no error text"
        others = sorted({r for r, _ in errors[1:]} - {rank})
        also = f" (then rank(s) {others} failed too)" if others else ""
        return (
            f"data_parallel: rank {rank} of {world_size} failed first: {last}{also}; torchrun "
            f"exit {returncode}. No output written; the other stages' results are kept."
        )
    lines = [line for line in launcher_tail.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    return (
        f"data_parallel: torchrun with {world_size} ranks failed (exit {returncode}) before any "
        f"rank reported an error: {last}. No output written; the other stages' results are kept."
    )
