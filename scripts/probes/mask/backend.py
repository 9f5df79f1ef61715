"""Which SDPA backend a recorded attention call gets on a target GPU, and why the faster ones don't.

The prediction encodes the CUDA filters of torch's ``select_sdp_backend``
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.h, torch 2.10+ on CUDA,
not ROCm): each backend is tried in priority order and the first whose filters all pass wins. It
works from shapes, strides, dtype and mask presence only, so it runs on a machine with no GPU.
On a CUDA machine :func:`confirm_with_torch` asks torch itself (``torch._fused_sdp_choice`` and the
``torch.backends.cuda.can_use_*`` checks) and the gate reports where the two disagree.

Priority order per torch release (``priority_order()`` / ``check_prefer_cudnn_attention()`` in
sdp_utils.cpp; the default order is ``at::Context``'s flash, efficient, math, cuDNN). Sources are
the sdp_utils.cpp text of each era and the pytorch/pytorch pull requests named:

=============  =================================================================================
torch          cuDNN goes first (cuDNN, flash, efficient, math) when
=============  =================================================================================
2.0 - 2.4      never. 2.0/2.1 have no cuDNN backend; 2.2-2.4 try it last and only with
               TORCH_CUDNN_SDPA_ENABLED=1 (#125343, default-on for H100, was reverted for 2.4 by
               #128539).
2.5            the GPU is sm90 or newer (``dprops->major >= 9``) and torch was built with
               cuDNN >= 9.0: the 2.5 release made cuDNN the H100 default.
2.6 - 2.8      never: #138522 deprioritised cuDNN after the 2.5 bugs (#139298);
               ``priority_order()`` returns the default order (see #141133, #142132).
2.9            sm90 or sm100 (minor 0) and torch built with cuDNN >= 9.9.0 (#162073, "for 2.9");
               TORCH_CUDNN_SDPA_PREFERRED=0 opts out.
2.10 and on    the *runtime* cuDNN is > 9.15.0 (9.15.1 fixed seq_len % 128 != 0, #169849, #171627)
               and the GPU is sm90, sm100 or sm103 for CUDA 12 builds (#170800), any sm9x/sm10x
               for CUDA 13 builds; TORCH_CUDNN_SDPA_DEPRIORITIZED=1 opts out. The 2.10 PyPI wheel
               bundles cuDNN 9.10.2, so it keeps flash first; 2.11's cu130 wheel bundles 9.19 and
               puts cuDNN first: measured on an H200 (docs/evidence/h200-2026-11-30: every SDPA call
               of Gemma 3 270M ran in cuDNN).
=============  =================================================================================

When the config gives no cuDNN version, the target's is the one the torch release's default
Linux x86-64 wheel bundles (:data:`BUNDLED_CUDNN`); a release newer than the table is assumed to
bundle at least the newest cuDNN listed, and the target says so (``cudnn_version_source``).

Not modelled (assumed favourable): runtime-disabled backends, deterministic mode, storage-offset
alignment for the efficient kernel, nested tensors, the opt-out environment variables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FLASH = "flash"
EFFICIENT = "efficient"
CUDNN = "cudnn"
MATH = "math"
EAGER = "eager"  # the model does not go through SDPA at all (e.g. Gemma 2's softcapping)

HALF_DTYPES = ("float16", "bfloat16")
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)
CUDNN_FIRST_ORDER = (CUDNN, FLASH, EFFICIENT, MATH)
RULES_SOURCE = "torch sdp_utils.cpp (CUDA, torch>=2.10): select_sdp_backend filters"

# When each torch release puts cuDNN first (see the module docstring): first release -> rule.
NEVER = "never"
SM90_PLUS = "sm90+ and cuDNN >= 9.0"
SM90_SM100_CUDNN_9_9 = "sm90/sm100 and cuDNN >= 9.9.0"
CUDNN_ABOVE_9_15 = "runtime cuDNN > 9.15.0 on sm90/sm100/sm103 (CUDA 12) or sm9x/sm10x (CUDA 13)"
CUDNN_FIRST_RULES: tuple[tuple[tuple[int, int], str, str], ...] = (
    ((2, 0), NEVER, "no cuDNN backend (2.0/2.1); tried last and opt-in (2.2-2.4, #128539)"),
    ((2, 5), SM90_PLUS, "2.5 release: cuDNN the default on H100 and newer"),
    ((2, 6), NEVER, "#138522 deprioritised cuDNN after the 2.5 bugs"),
    ((2, 9), SM90_SM100_CUDNN_9_9, "#162073: cuDNN first on sm90/sm100 for 2.9"),
    ((2, 10), CUDNN_ABOVE_9_15, "#171627/#169849, #170800: cuDNN first above 9.15.0"),
)
# cuDNN (torch.backends.cudnn.version() form) and CUDA major of each release's default Linux
# x86-64 wheel; used when mask.cudnn_version is null.
BUNDLED_CUDNN: dict[tuple[int, int], tuple[int, int, str]] = {
    (2, 5): (90100, 12, "cu124 wheel, nvidia-cudnn-cu12 9.1.0.70"),
    (2, 6): (90100, 12, "cu124 wheel, nvidia-cudnn-cu12 9.1.0.70"),
    (2, 7): (90501, 12, "cu126 wheel, nvidia-cudnn-cu12 9.5.1.17"),
    (2, 8): (91002, 12, "cu128 wheel, nvidia-cudnn-cu12 9.10.2.21"),
    (2, 9): (91002, 12, "cu128 wheel, nvidia-cudnn-cu12==9.10.2.21 (PyPI metadata)"),
    (2, 10): (91002, 12, "cu128 wheel, nvidia-cudnn-cu12==9.10.2.21 (PyPI metadata)"),
    (2, 11): (91900, 13, "cu130 wheel, cuDNN 9.19 as torch reported it on an H200 (docs/evidence)"),
}


@dataclass(frozen=True)
class SdpaCall:
    """The arguments of one call into scaled_dot_product_attention, without tensor data."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    k_stride: tuple[int, ...]
    v_stride: tuple[int, ...]
    dtype: str
    is_causal: bool
    enable_gqa: bool
    dropout_p: float = 0.0
    mask_shape: tuple[int, ...] | None = None
    mask_dtype: str | None = None
    mask_last_stride: int | None = None

    @property
    def mask_present(self) -> bool:
        return self.mask_shape is not None

    @property
    def head_dim_qk(self) -> int:
        return self.q_shape[-1]

    @property
    def head_dim_v(self) -> int:
        return self.v_shape[-1]


@dataclass(frozen=True)
class Target:
    """The GPU and software the prediction is for."""

    compute_capability: tuple[int, int] = (9, 0)
    cudnn_version: int | None = None  # e.g. 91002 for cuDNN 9.10.2; None = unknown
    prefer_cudnn: bool | None = None  # None: derive from torch_version and cudnn_version
    requires_grad: bool = True  # a training step: q/k/v carry gradients
    torch_version: str = ""  # "" = unknown: the newest rules
    cuda_major: int | None = None  # CUDA major torch was built with; None: from torch_version
    cudnn_version_source: str = "given"

    @property
    def sm(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    def priority_order(self) -> tuple[str, ...]:
        return CUDNN_FIRST_ORDER if self.cudnn_preferred() else DEFAULT_ORDER

    def cudnn_first_rule(self) -> tuple[str, str]:
        """(rule, source) of torch's check_prefer_cudnn_attention for this torch release."""
        release = torch_release(self.torch_version)
        chosen = CUDNN_FIRST_RULES[-1]
        if release is not None:
            chosen = next(
                (entry for entry in reversed(CUDNN_FIRST_RULES) if release >= entry[0]),
                CUDNN_FIRST_RULES[0],
            )
        return chosen[1], chosen[2]

    def cudnn_preferred(self) -> bool:
        """Whether torch's priority order starts with cuDNN here (check_prefer_cudnn_attention)."""
        if self.prefer_cudnn is not None:
            return self.prefer_cudnn
        version = self.cudnn_version
        if version is None:
            return False
        major, minor = self.compute_capability
        rule, _ = self.cudnn_first_rule()
        if rule == SM90_PLUS:
            return version >= 90000 and major >= 9
        if rule == SM90_SM100_CUDNN_9_9:
            return version >= 90900 and major in (9, 10) and minor == 0
        if rule == CUDNN_ABOVE_9_15:
            cuda_major = self.cuda_major or cuda_major_of(self.torch_version)
            any_minor = cuda_major is not None and cuda_major >= 13
            return version > 91500 and major in (9, 10) and (any_minor or minor in (0, 3))
        return False


@dataclass
class Prediction:
    backend: str
    excluded: dict[str, str] = field(
        default_factory=dict
    )  # faster backend -> the rule that excluded it

    def excluded_by(self) -> str:
        return "; ".join(f"{name}: {reason}" for name, reason in self.excluded.items())


def parse_compute_capability(value: str | float | tuple[int, int]) -> tuple[int, int]:
    """'9.0', 9.0, 'sm90', '90' or (9, 0) -> (9, 0)."""
    if isinstance(value, tuple):
        return int(value[0]), int(value[1])
    text = str(value).strip().lower().removeprefix("sm_").removeprefix("sm")
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major), int(minor or 0)
    if text.isdigit() and len(text) >= 2:
        return int(text[:-1]), int(text[-1])
    if text.isdigit():
        return int(text), 0
    raise ValueError(f"cannot read compute capability {value!r}; write it like '9.0' or 'sm90'")


def _in_sm_range(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= cc <= high


def _heads_ok(call: SdpaCall, supports_gqa: bool) -> str | None:
    if not (call.q_shape[0] == call.k_shape[0] == call.v_shape[0]):
        return "q/k/v batch sizes differ"
    q_heads, k_heads, v_heads = call.q_shape[-3], call.k_shape[-3], call.v_shape[-3]
    if call.enable_gqa and supports_gqa:
        if k_heads != v_heads or q_heads % k_heads:
            return f"GQA needs kv heads dividing q heads (q={q_heads}, k={k_heads}, v={v_heads})"
        return None
    if not (q_heads == k_heads == v_heads):
        return f"num_heads differ without enable_gqa (q={q_heads}, k={k_heads})"
    return None


def _strides_ok(call: SdpaCall, ignore_singleton_dim: bool) -> str | None:
    qkv_ok = call.q_stride[-1] == 1 and call.k_stride[-1] == 1 and call.v_stride[-1] == 1
    if ignore_singleton_dim:
        qkv_ok = qkv_ok or call.q_shape[-1] == 1
    if not qkv_ok:
        return "q/k/v last-dim stride != 1"
    if call.mask_present and call.mask_last_stride not in (None, 1):
        return "attn_mask last-dim stride != 1"
    return None


def _zero_len(call: SdpaCall) -> str | None:
    if call.q_shape[-2] == 0 or call.k_shape[-2] == 0:
        return "zero sequence length"
    return None


def flash_exclusion(call: SdpaCall, target: Target) -> str | None:
    """The first flash-attention filter that fails, or None if flash can run."""
    cc = target.compute_capability
    if len(call.q_shape) != 4:
        return "q/k/v not 4-D"
    if call.mask_present:
        return "attn_mask present (flash takes no mask, only is_causal)"
    d_q, d_k, d_v = call.q_shape[-1], call.k_shape[-1], call.v_shape[-1]
    if not (d_q == d_k == d_v):
        return f"q/k/v head_dim differ ({d_q}/{d_k}/{d_v})"
    if d_q > 256:
        return f"head_dim {d_q} > 256"
    if not _in_sm_range(cc, (8, 0), (12, 1)):
        return f"{target.sm} outside flash's [sm80, sm121]"
    sm86_89 = _in_sm_range(cc, (8, 6), (8, 9))
    sm120_121 = _in_sm_range(cc, (12, 0), (12, 1))
    if target.requires_grad and (sm86_89 or sm120_121):
        supported = d_q <= 192 or (call.dropout_p == 0.0 and d_q > 224)
        if not supported:
            return f"training with head_dim {d_q} unsupported on {target.sm}"
    if call.is_causal and call.q_shape[-2] != call.k_shape[-2]:
        return "is_causal with seqlen_q != seqlen_k"
    allowed = HALF_DTYPES if cc[0] >= 8 else ("float16",)
    if call.dtype not in allowed:
        return f"dtype {call.dtype} (flash needs {'/'.join(allowed)})"
    return _heads_ok(call, supports_gqa=True) or _zero_len(call) or _strides_ok(call, True)


def _gemm_alignment(call: SdpaCall, cc: tuple[int, int]) -> int:
    # minimum_gemm_alignment(): 8 elements for 16-bit dtypes on tensor cores, 4 for fp32 on sm80+
    is_half = call.dtype in HALF_DTYPES
    use_tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and is_half)
    alignment = 4 if cc[0] >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def efficient_exclusion(call: SdpaCall, target: Target) -> str | None:
    """The first memory-efficient-attention filter that fails, or None."""
    cc = target.compute_capability
    if not _in_sm_range(cc, (5, 0), (12, 1)):
        return f"{target.sm} outside efficient's [sm50, sm121]"
    if len(call.q_shape) != 4:
        return "q/k/v not 4-D"
    alignment = _gemm_alignment(call, cc)
    d_q, d_k, d_v = call.q_shape[-1], call.k_shape[-1], call.v_shape[-1]
    if d_q != d_k:
        return f"q/k head_dim differ ({d_q}/{d_k})"
    if d_q % alignment or d_v % alignment or d_q <= 0 or d_v <= 0:
        return f"head_dim {d_q}/{d_v} not a multiple of {alignment}"
    reason = _zero_len(call) or _strides_ok(call, False) or _heads_ok(call, supports_gqa=True)
    if reason:
        return reason
    allowed = ("float16", "float32", "bfloat16") if cc[0] >= 8 else ("float16", "float32")
    if call.dtype not in allowed:
        return f"dtype {call.dtype} (efficient needs {'/'.join(allowed)} on {target.sm})"
    return None


def _mask_shape_ok(call: SdpaCall) -> bool:
    shape = call.mask_shape
    if shape is None:
        return True
    q_len, kv_len = call.q_shape[-2], call.k_shape[-2]
    if shape[-2] not in (q_len, 1) or shape[-1] not in (kv_len, 1):
        return False
    if len(shape) == 2:
        return True
    return len(shape) == 4 and shape[0] in (1, call.q_shape[0]) and shape[1] in (1, call.q_shape[1])


def torch_release(version: str) -> tuple[int, int] | None:
    """'2.11.0+cu130' -> (2, 11); None when unreadable."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def cuda_major_of(torch_version: str) -> int | None:
    """The CUDA major a torch build targets: its local tag (+cu130 -> 13), else the default
    wheel's from BUNDLED_CUDNN; None for an unknown release without a tag."""
    local = torch_version.split("+", 1)[1] if "+" in torch_version else ""
    if local.startswith("cu") and local[2:].isdigit() and len(local) >= 4:
        return int(local[2:-1])
    bundled = bundled_cudnn(torch_version)
    return bundled[1] if bundled else None


def bundled_cudnn(torch_version: str) -> tuple[int, int, str] | None:
    """(cuDNN, CUDA major, source) of the release's default wheel; a release newer than the
    table gets the newest entry, marked as assumed; None for older or unreadable versions."""
    release = torch_release(torch_version)
    if release is None:
        return None
    if release in BUNDLED_CUDNN:
        return BUNDLED_CUDNN[release]
    newest = max(BUNDLED_CUDNN)
    if release > newest:
        cudnn, cuda, _ = BUNDLED_CUDNN[newest]
        return (
            cudnn,
            cuda,
            (
                f"assumed: torch {release[0]}.{release[1]} is newer than the table; at least the "
                f"cuDNN of torch {newest[0]}.{newest[1]}'s wheel"
            ),
        )
    return None


def resolve_target(
    compute_capability: tuple[int, int],
    torch_version: str,
    cudnn_version: int | None = None,
    prefer_cudnn: bool | None = None,
    requires_grad: bool = True,
) -> Target:
    """The target for a torch release: a cuDNN version not given is the one its wheel bundles."""
    source = "given (mask.cudnn_version)"
    cuda_major = cuda_major_of(torch_version)
    if cudnn_version is None:
        bundled = bundled_cudnn(torch_version)
        if bundled is None:
            source = f"unknown: torch {torch_version or '?'} is not in the bundled-cuDNN table"
        else:
            cudnn_version, _, source = bundled
            source = f"bundled with torch {torch_version}: {source}"
    return Target(
        compute_capability=compute_capability,
        cudnn_version=cudnn_version,
        prefer_cudnn=prefer_cudnn,
        requires_grad=requires_grad,
        torch_version=torch_version,
        cuda_major=cuda_major,
        cudnn_version_source=source,
    )


def _cudnn_d256_min_version(target: Target) -> int:
    """Smallest cuDNN that torch lets run 256-wide heads on sm90/sm10x.

    Measured on an H200 (docs/evidence/h200-2026-11-30): torch 2.11 with cuDNN 9.19 sends
    head_dim 256 to cuDNN, so torch <= 2.11 gates it at 9.5.1. The > 9.22 gate is read from newer
    torch source; which release moved it is not verified, so it applies from 2.12 on (and when the
    torch version is unknown).
    """
    minor = torch_release(target.torch_version)
    if minor is not None and minor <= (2, 11):
        return 90501
    return 92201


def cudnn_exclusion(call: SdpaCall, target: Target) -> str | None:
    """The first cuDNN-attention filter that fails, or None."""
    cc = target.compute_capability
    version = target.cudnn_version
    if version is not None and version < 90000:
        return f"cuDNN {version} < 9.0"
    if version is not None and call.dropout_p > 0 and 91100 < version < 91400:
        return "dropout unsupported on cuDNN 9.11-9.13"
    if len(call.q_shape) != 4:
        return "q/k/v not 4-D"
    allowed = HALF_DTYPES if cc[0] >= 8 else ("float16",)
    if call.dtype not in allowed:
        return f"dtype {call.dtype} (cuDNN needs {'/'.join(allowed)})"
    if not _mask_shape_ok(call):
        return f"attn_mask shape {call.mask_shape} unsupported"
    if not _in_sm_range(cc, (8, 0), (12, 1)):
        return f"{target.sm} outside cuDNN's [sm80, sm121]"
    if call.dropout_p * 16.0 != int(call.dropout_p * 16.0):
        return "dropout not a multiple of 1/16"
    reason = _zero_len(call) or _strides_ok(call, True)
    if reason:
        return reason
    q_heads, k_heads = call.q_shape[-3], call.k_shape[-3]
    if k_heads != call.v_shape[-3] or q_heads % k_heads:
        return f"kv heads must divide q heads (q={q_heads}, k={k_heads})"
    if call.q_shape[0] > 65535 or q_heads > 65535:
        return "batch or num_heads > 65535"
    d_qk, d_v = call.head_dim_qk, call.head_dim_v
    sm90_or_10x = cc == (9, 0) or cc[0] == 10
    known = version is not None
    supports_d256 = sm90_or_10x and known and version >= _cudnn_d256_min_version(target)
    limit = 128
    if supports_d256:
        limit = 256
    elif sm90_or_10x and known and version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit:
        unknown = "" if known else " (cuDNN version unknown: assumed limit)"
        return f"head_dim {max(d_qk, d_v)} > {limit}{unknown}"
    if d_qk % 8 or d_v % 8:
        return f"head_dim {d_qk}/{d_v} not a multiple of 8"
    if call.k_shape[-2] == 1:
        return "key length 1"
    if target.requires_grad and supports_d256:
        bprop_ok = (
            (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) == (192, 128) or (d_qk, d_v) == (256, 256)
        )
        if not bprop_ok:
            return f"backward unsupported for head dims {d_qk}/{d_v}"
    return None


EXCLUSION_RULES = {FLASH: flash_exclusion, EFFICIENT: efficient_exclusion, CUDNN: cudnn_exclusion}


def predict_backend(call: SdpaCall, target: Target) -> Prediction:
    """Walk torch's priority order; the first backend whose filters pass is the one SDPA runs."""
    excluded: dict[str, str] = {}
    for backend in target.priority_order():
        if backend == MATH:
            return Prediction(MATH, excluded)
        reason = EXCLUSION_RULES[backend](call, target)
        if reason is None:
            return Prediction(backend, excluded)
        excluded[backend] = reason
    return Prediction(MATH, excluded)


def target_as_dict(target: Target) -> dict[str, Any]:
    out = asdict(target)
    out["compute_capability"] = f"{target.compute_capability[0]}.{target.compute_capability[1]}"
    out["priority_order"] = list(target.priority_order())
    rule, rule_source = target.cudnn_first_rule()
    out["cudnn_first_rule"] = f"{rule} ({rule_source})"
    out["rules_source"] = RULES_SOURCE
    return out
