"""The idle-card guard, with a faked card (no GPU needed)."""

import subprocess

import pytest

from probes.step.idle import (
    CardBusyError,
    CardState,
    GpuProcess,
    IdleLimits,
    busy_reasons,
    physical_device_id,
    query_nvidia_smi,
    wait_for_idle_card,
)

IDLE = CardState("0", "NVIDIA H200", 3.0, 143771.0, 0.0, [])
BUSY = CardState(
    "0", "NVIDIA H200", 60000.0, 143771.0, 97.0, [GpuProcess(4242, "python3", 59000.0)]
)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self):
        return self.now


def test_busy_card_fails_naming_what_holds_it():
    clock = FakeClock()
    with pytest.raises(CardBusyError) as error:
        wait_for_idle_card(
            lambda: BUSY,
            IdleLimits(),
            timeout_s=100,
            initial_backoff_s=5,
            max_backoff_s=30,
            sleep=clock.sleep,
            clock=clock.clock,
        )
    message = str(error.value)
    assert "pid 4242" in message and "python3" in message
    assert "60000 MiB" in message and "97%" in message
    # bounded back-off: 5, 10, 20, 30, 30 -> the next 30 would pass the 100 s deadline
    assert clock.sleeps == [5, 10, 20, 30, 30]
    assert sum(clock.sleeps) <= 100


def test_card_that_frees_up_is_used():
    states = iter([BUSY, BUSY, IDLE])
    clock = FakeClock()
    state, polls = wait_for_idle_card(
        lambda: next(states), IdleLimits(), timeout_s=600, sleep=clock.sleep, clock=clock.clock
    )
    assert state is IDLE and polls == 3
    assert clock.sleeps == [5.0, 10.0]


def test_own_process_and_limits():
    mine = CardState("0", "x", 500.0, 1000.0, 5.0, [GpuProcess(77, "python", 400.0)])
    assert busy_reasons(mine, IdleLimits(), own_pid=77) == []
    assert busy_reasons(mine, IdleLimits(), own_pid=1) != []
    assert busy_reasons(mine, IdleLimits(allow_other_processes=True), own_pid=1) == []
    assert busy_reasons(mine, IdleLimits(max_memory_used_mib=100), own_pid=77) != []


def test_visible_devices_map_to_physical_ids():
    assert physical_device_id(0, "3,5") == "3"
    assert physical_device_id(1, "GPU-abc,GPU-def") == "GPU-def"
    assert physical_device_id(0, "") == "0"


def test_nvidia_smi_output_is_parsed_per_card():
    def fake_run(cmd, **kwargs):
        if any(arg.startswith("--query-gpu") for arg in cmd):
            out = "GPU-aaa, NVIDIA H200, 61234, 143771, 88\n"
        else:
            out = "GPU-aaa, 4242, python3, 61000\nGPU-bbb, 999, other, 100\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    state = query_nvidia_smi("0", run=fake_run)
    assert state.name == "NVIDIA H200" and state.utilization_pct == 88.0
    assert [p.pid for p in state.processes] == [4242]  # the other card's process is not ours
