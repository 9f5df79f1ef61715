"""Which dtype the profile computes in: bfloat16 only where the device computes it natively.

A CPU without bfloat16 units emulates it: on a 2-core AVX2 EPYC a bf16 matmul of 256x640 by
640x2048 took 1,380 ms against 14 ms in float32 (issue 13), so `profile.dtype: auto` there means
float32. The decision is a pure function of the request, the device type and the CPU's facts
(`CpuBf16Facts`), so it is unit-tested with the facts made up both ways; `cpu_bf16_facts()` reads
them from torch on the machine that runs.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

LOG = logging.getLogger("probes.dtype")
AUTO = "auto"
BFLOAT16 = "bfloat16"
FLOAT16 = "float16"
FLOAT32 = "float32"
# the values profile.dtype takes (workflow/schemas/config.schema.yaml)
REQUESTABLE = (AUTO, BFLOAT16, FLOAT16, FLOAT32)
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


@dataclass(frozen=True)
class CpuBf16Facts:
    """What this CPU and this torch build say about bfloat16."""

    machine: str  # platform.machine(), e.g. x86_64, aarch64
    capability: str  # torch.backends.cpu.get_cpu_capability(), e.g. AVX2, AVX512
    avx512_bf16: bool  # x86 AVX512_BF16 instructions
    amx_bf16: bool  # x86 AMX tiles (AMX-BF16)
    onednn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported()

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in X86_MACHINES

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run on bf16 units through oneDNN rather than emulated.

        On x86 the oneDNN flag alone is not enough: oneDNN also reports bf16 on AVX512 cores
        without BF16 units, where it converts to float32. There the units must be present too.
        Elsewhere (aarch64) torch's oneDNN flag is itself the check for the CPU's bf16 feature.
        """
        if not self.onednn_bf16:
            return False
        if self.is_x86:
            return self.avx512_bf16 or self.amx_bf16
        return True

    def describe(self) -> str:
        flags = (("AVX512_BF16", self.avx512_bf16), ("AMX", self.amx_bf16))
        units = [name for name, has in flags if has]
        return (
            f"{self.machine} CPU, torch capability {self.capability}, "
            f"bf16 units: {', '.join(units) if units else 'none'}, "
            f"oneDNN bf16: {'yes' if self.onednn_bf16 else 'no'}"
        )


def cpu_bf16_facts() -> CpuBf16Facts:
    """The facts of the CPU this process runs on, as torch reports them."""
    import torch

    def flag(check) -> bool:
        try:
            return bool(check())
        except (AttributeError, RuntimeError):  # a torch without this check: not known to have it
            return False

    return CpuBf16Facts(
        machine=platform.machine(),
        capability=str(torch.backends.cpu.get_cpu_capability()),
        avx512_bf16=flag(lambda: torch.cpu._is_avx512_bf16_supported()),
        amx_bf16=flag(lambda: torch.cpu._is_amx_tile_supported()),
        onednn_bf16=flag(lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    )


def bf16_emulated(dtype_name: str, device_type: str, cpu: CpuBf16Facts | None) -> bool:
    """Whether computing in `dtype_name` on this device means emulating bf16 on the CPU."""
    on_cpu = device_type == "cpu" and cpu is not None
    return dtype_name == BFLOAT16 and on_cpu and not cpu.native_bf16


def choose_dtype(requested: str, device_type: str, cpu: CpuBf16Facts | None) -> tuple[str, str]:
    """(dtype name, why) for profile.dtype `requested` on a `device_type` ("cuda" or "cpu") device.

    `cpu` is needed only for device_type "cpu". An explicit dtype is always honoured; the reason
    then says when it is emulated on this CPU, so the slow numbers explain themselves.
    """
    if requested not in REQUESTABLE:
        raise ValueError(f"profile.dtype: {requested!r} is not one of {', '.join(REQUESTABLE)}")
    if device_type == "cpu" and cpu is None:
        raise ValueError("choose_dtype needs the CPU's facts (cpu_bf16_facts()) for a CPU device")
    if requested != AUTO:
        reason = f"profile.dtype: {requested} (set in the config)"
        if bf16_emulated(requested, device_type, cpu):
            reason += f"; bfloat16 is emulated on this CPU ({cpu.describe()}), so steps are slow"
        return requested, reason
    if device_type == "cuda":
        return BFLOAT16, "auto: bfloat16 on a CUDA device"
    if cpu.native_bf16:
        return BFLOAT16, f"auto: bfloat16, native on this CPU ({cpu.describe()})"
    return FLOAT32, f"auto: float32, bfloat16 would be emulated on this CPU ({cpu.describe()})"


def resolve_dtype(requested: str, device_type: str) -> tuple[str, str]:
    """choose_dtype for this machine, with a warning when an explicit bf16 is emulated here."""
    cpu = cpu_bf16_facts() if device_type == "cpu" else None
    name, reason = choose_dtype(requested, device_type, cpu)
    if requested != AUTO and bf16_emulated(name, device_type, cpu):
        LOG.warning(
            "profile.dtype: %s is emulated on this CPU (%s): each step may take ~100x longer "
            "than in float32; set profile.dtype: auto or float32 for a CPU run",
            name,
            cpu.describe(),
        )
    LOG.info("dtype %s (%s)", name, reason)
    return name, reason
