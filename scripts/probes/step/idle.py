"""Run only on an idle card: check other compute processes, memory in use and utilisation before
loading weights; wait with a bounded, logged back-off; then fail naming what holds the card.

A step timed next to someone else's job measures the contention, not the step.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from probes.errors import ProbeError
from probes.settings import IdleConfig

LOG = logging.getLogger("probes.step.idle")


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_memory_mib: float


@dataclass(frozen=True)
class CardState:
    device_id: str  # what nvidia-smi -i accepts: physical index or UUID
    name: str
    memory_used_mib: float
    memory_total_mib: float
    utilization_pct: float | None
    processes: list[GpuProcess] = field(default_factory=list)
    source: str = "nvidia-smi"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class IdleLimits:
    max_memory_used_mib: float = 1024.0
    max_utilization_pct: float = 10.0
    allow_other_processes: bool = False


class CardBusyError(ProbeError, RuntimeError):
    """The card stayed busy for the whole wait; the message names what holds it."""


def busy_reasons(state: CardState, limits: IdleLimits, own_pid: int | None = None) -> list[str]:
    """Why this card is not idle (empty list: idle)."""
    own = os.getpid() if own_pid is None else own_pid
    others = [p for p in state.processes if p.pid != own]
    reasons = []
    if others and not limits.allow_other_processes:
        listed = ", ".join(f"pid {p.pid} ({p.name}, {p.used_memory_mib:.0f} MiB)" for p in others)
        reasons.append(f"{len(others)} other compute process(es): {listed}")
    if state.memory_used_mib > limits.max_memory_used_mib:
        reasons.append(
            f"{state.memory_used_mib:.0f} MiB of {state.memory_total_mib:.0f} MiB in use "
            f"(limit {limits.max_memory_used_mib:.0f} MiB)"
        )
    if state.utilization_pct is not None and state.utilization_pct > limits.max_utilization_pct:
        reasons.append(
            f"utilisation {state.utilization_pct:.0f}% (limit {limits.max_utilization_pct:.0f}%)"
        )
    return reasons


def physical_device_id(index: int, visible: str | None = None) -> str:
    """torch's device index -> the id nvidia-smi knows, through CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(entries):
            return entries[index]
    return str(index)


def _smi(args: list[str], run: Callable[..., Any]) -> list[list[str]]:
    out = run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]" under MIG or on some drivers
        return None


def query_nvidia_smi(device_id: str, run: Callable[..., Any] = subprocess.run) -> CardState:
    """One card's memory, utilisation and compute processes (all GPUs' processes are filtered by
    the card's UUID)."""
    rows = _smi(
        ["-i", device_id, "--query-gpu=uuid,name,memory.used,memory.total,utilization.gpu"], run
    )
    if not rows:
        raise RuntimeError(f"nvidia-smi returned nothing for device {device_id}")
    uuid, name, used, total, util = rows[0][:5]
    processes = []
    for row in _smi(["--query-compute-apps=gpu_uuid,pid,process_name,used_memory"], run):
        if len(row) >= 4 and row[0] == uuid:
            processes.append(GpuProcess(int(row[1]), row[2], _number(row[3]) or 0.0))
    return CardState(
        device_id=device_id,
        name=name,
        memory_used_mib=_number(used) or 0.0,
        memory_total_mib=_number(total) or 0.0,
        utilization_pct=_number(util),
        processes=processes,
        source="nvidia-smi",
    )


def query_torch(index: int) -> CardState:
    """Fallback without nvidia-smi: memory from the driver, utilisation if pynvml is present.
    Creating the CUDA context here costs a few hundred MiB, counted as in use."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    try:
        util: float | None = float(torch.cuda.utilization(index))
    except Exception:  # needs pynvml
        util = None
    return CardState(
        device_id=str(index),
        name=torch.cuda.get_device_name(index),
        memory_used_mib=(total - free) / 2**20,
        memory_total_mib=total / 2**20,
        utilization_pct=util,
        processes=[],
        source="torch.cuda (no nvidia-smi: other processes cannot be listed)",
    )


def probe_card(index: int) -> CardState:
    try:
        return query_nvidia_smi(physical_device_id(index))
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as error:
        LOG.warning("nvidia-smi unusable (%s); falling back to torch.cuda", type(error).__name__)
        return query_torch(index)


def wait_for_idle_card(
    probe: Callable[[], CardState],
    limits: IdleLimits,
    timeout_s: float,
    initial_backoff_s: float = 5.0,
    max_backoff_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[CardState, int]:
    """Poll until the card is idle; back off x2 up to max_backoff_s; give up after timeout_s.

    Returns the idle state and the number of polls. Raises CardBusyError naming what holds the
    card when it is still busy at the deadline.
    """
    start = clock()
    backoff = initial_backoff_s
    polls = 0
    while True:
        state = probe()
        polls += 1
        reasons = busy_reasons(state, limits)
        if not reasons:
            LOG.info("card %s (%s) is idle after %d poll(s)", state.device_id, state.name, polls)
            return state, polls
        waited = clock() - start
        if waited + backoff > timeout_s:
            raise CardBusyError(
                f"GPU {state.device_id} ({state.name}) is not idle after {waited:.0f} s "
                f"({polls} polls): {'; '.join(reasons)}. Wait for that job, pick another card "
                "(CUDA_VISIBLE_DEVICES), or raise profile.idle limits if you accept the noise."
            )
        LOG.warning(
            "card %s busy (%s); retrying in %.0f s (waited %.0f of %.0f s)",
            state.device_id,
            "; ".join(reasons),
            backoff,
            waited,
            timeout_s,
        )
        sleep(backoff)
        backoff = min(backoff * 2, max_backoff_s)


def check_idle_card(
    idle: IdleConfig,
    device: Any,
    card_probe: Callable[[int], CardState] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The idle-card check of a GPU stage (the profile section's `idle` limits), as a provenance
    record; on CPU nothing to check. Used by the profile, replay and realize stages."""
    if device.type != "cuda":
        return {"checked": False, "reason": "CPU run: no card to check"}
    limits = IdleLimits(
        idle.max_memory_used_mib, idle.max_utilization_pct, idle.allow_other_processes
    )
    probe = card_probe or probe_card
    state, polls = wait_for_idle_card(
        lambda: probe(device.index or 0),
        limits,
        idle.timeout_s,
        idle.initial_backoff_s,
        idle.max_backoff_s,
        sleep=sleep,
    )
    return {"checked": True, "polls": polls, "state": state.as_dict(), "limits": vars(limits)}
