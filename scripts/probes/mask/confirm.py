"""The SDPA backend torch itself picks on this machine's CUDA device: the confirmation of
``probes.mask.backend``'s prediction (CUDA only; elsewhere nothing runs and the record says why).
"""

from __future__ import annotations

from typing import Any

from probes.mask.backend import CUDNN, EFFICIENT, FLASH, MATH, SdpaCall, Target

_TORCH_BACKEND_NAMES = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN, 4: "overrideable", -1: "error"}


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install must not break the CPU gate
        return False


def local_target(requires_grad: bool = True) -> Target:
    """The Target of the CUDA device this process sees (only meaningful when CUDA is present)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    cuda = torch.version.cuda
    return Target(
        compute_capability=(major, minor),
        cudnn_version=torch.backends.cudnn.version(),
        requires_grad=requires_grad,
        torch_version=torch.__version__,
        cuda_major=int(cuda.split(".")[0]) if cuda else None,
        cudnn_version_source="this machine's torch.backends.cudnn.version()",
    )


def _torch_tensors(call: SdpaCall, device: str, requires_grad: bool) -> tuple[Any, ...]:
    import torch

    dtype = getattr(torch, call.dtype)

    def strided(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        tensor = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return tensor.requires_grad_(requires_grad)

    query = strided(call.q_shape, call.q_stride)
    key = strided(call.k_shape, call.k_stride)
    value = strided(call.v_shape, call.v_stride)
    mask = None
    if call.mask_present:
        # SDPA turns a boolean mask into an additive one of the query dtype before dispatch
        mask = torch.zeros(call.mask_shape, dtype=dtype, device=device)
    return query, key, value, mask


NO_CUDA = "not confirmed: no CUDA"


def confirm_with_torch(call: SdpaCall, device: str = "cuda", requires_grad: bool = True) -> dict:
    """Ask torch on a CUDA `device` which backend SDPA picks and which backends it can use.

    Returns {"ran": True, "backend": name, "can_use": {flash, efficient, cudnn: bool}}. Anywhere
    else torch's CUDA dispatch cannot be asked (the can_use_* checks answer False for CPU
    tensors, and the CPU chooses among its own kernels), so nothing runs and the record says why:
    {"ran": False, "backend": None, "can_use": {}, "reason": ...}.
    """
    import torch

    if not str(device).startswith("cuda") or not cuda_available():
        return {
            "ran": False,
            "backend": None,
            "can_use": {},
            "reason": f"{NO_CUDA} (device {device!r}, torch.cuda.is_available()="
            f"{bool(torch.cuda.is_available())})",
        }
    query, key, value, mask = _torch_tensors(call, device, requires_grad)
    params = torch.backends.cuda.SDPAParams(
        query, key, value, mask, call.dropout_p, call.is_causal, call.enable_gqa
    )
    can_use = {
        FLASH: bool(torch.backends.cuda.can_use_flash_attention(params, False)),
        EFFICIENT: bool(torch.backends.cuda.can_use_efficient_attention(params, False)),
        CUDNN: bool(torch.backends.cuda.can_use_cudnn_attention(params, False)),
    }
    backend = None
    fused_choice = getattr(torch, "_fused_sdp_choice", None)
    if fused_choice is not None:
        choice = fused_choice(
            query, key, value, mask, call.dropout_p, call.is_causal, enable_gqa=call.enable_gqa
        )
        backend = _TORCH_BACKEND_NAMES.get(int(choice), str(choice))
    return {"ran": True, "backend": backend, "can_use": can_use}
