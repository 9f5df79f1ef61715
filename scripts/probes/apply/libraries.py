"""What the installed transformers and TRL accept, and the check that a change's snippet does.

Facts about the installed versions are read from the classes themselves (dataclass fields and
their ``choices``), never assumed from a version number: transformers 5 replaced
``group_by_length=True`` with ``train_sampling_strategy="group_by_length"`` and does not validate
that field's choices on construction, so verification checks them. ``verify_document`` executes
each snippet's argument lines against the installed libraries and reads every kwarg back from
the constructed ``TrainingArguments``/``SFTConfig``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

SAMPLING_FIELD = "train_sampling_strategy"  # transformers ≥ 5
LEGACY_GROUP_FLAG = "group_by_length"  # transformers 4.x boolean
CHECKPOINTING = "activation_checkpointing"  # transformers >= 5.25
LEGACY_CHECKPOINTING = "gradient_checkpointing"  # its deprecated alias
DEPRECATIONS = (FutureWarning, DeprecationWarning)  # what a pasted setting must not raise
# Values of TrainingArguments.train_sampling_strategy (transformers' names, not the sweep's).
HF_GROUP_BY_LENGTH = "group_by_length"
HF_BATCH_REBALANCE = "batch_rebalance"
HF_RANDOM = "random"

# --------------------------------------------------------------------------------------------
# What the installed libraries accept
# --------------------------------------------------------------------------------------------


def _field_choices(cls: type) -> dict[str, list[str] | None]:
    """Every dataclass field of ``cls`` → its declared choices (None when unconstrained)."""
    out: dict[str, list[str] | None] = {}
    for f in dataclasses.fields(cls):
        choices = f.metadata.get("choices") if f.metadata else None
        out[f.name] = [str(c) for c in choices] if choices is not None else None
    return out


def installed_libraries() -> dict[str, Any]:
    """Versions and the relevant fields of TrainingArguments and SFTConfig, read from the classes.

    ``{"transformers": {"version", "sampling_field", "sampling_strategies"} | {"version": None,
    "reason"}, "trl": {"version", "packing_strategies", "padding_free"} | {"version": None,
    "reason"}}``.
    """
    libraries: dict[str, Any] = {}
    try:
        import transformers
        from transformers import TrainingArguments
    except ImportError as error:
        libraries["transformers"] = {"version": None, "reason": f"not importable: {error}"}
    else:
        fields = _field_choices(TrainingArguments)
        if SAMPLING_FIELD in fields:
            sampling_field, strategies = SAMPLING_FIELD, fields[SAMPLING_FIELD]
        elif LEGACY_GROUP_FLAG in fields:
            sampling_field, strategies = LEGACY_GROUP_FLAG, [HF_RANDOM, HF_GROUP_BY_LENGTH]
        else:
            sampling_field, strategies = None, []
        libraries["transformers"] = {
            "version": transformers.__version__,
            "sampling_field": sampling_field,
            "sampling_strategies": strategies or [],
        }
    try:
        import trl
        from trl import SFTConfig
    except ImportError as error:
        libraries["trl"] = {"version": None, "reason": f"not importable: {error}"}
    else:
        fields = _field_choices(SFTConfig)
        libraries["trl"] = {
            "version": trl.__version__,
            "packing": "packing" in fields,
            "packing_strategies": fields.get("packing_strategy") or [],
            "padding_free": "padding_free" in fields,
        }
    return libraries


def sft_checkpointing(checkpointing: bool | None = None) -> dict[str, Any]:
    """SFTConfig kwargs that keep a pasted SFTConfig off deprecated names and off TRL's own
    checkpointing default: TRL (1.16) sets ``gradient_checkpointing=True``, which transformers
    5.25 resolves as the deprecated alias with a FutureWarning on every construction, and which
    turns recomputation on for a run that trained without it. The current name
    (``activation_checkpointing``) at the run's own value (`checkpointing`; TRL's default where
    the probes did not see the run's) warns nothing and changes nothing but what the change is.
    {} where the installed TrainingArguments has no new name or TRL sets no such default."""
    try:
        from transformers import TrainingArguments
        from trl import SFTConfig
    except ImportError:
        return {}
    ta = {f.name for f in dataclasses.fields(TrainingArguments)}
    sft = {f.name: f for f in dataclasses.fields(SFTConfig)}
    old = sft.get(LEGACY_CHECKPOINTING)
    if CHECKPOINTING not in ta or old is None or old.default in (None, dataclasses.MISSING):
        return {}
    return {CHECKPOINTING: bool(old.default if checkpointing is None else checkpointing)}


def sampling_kwargs(strategy: str, transformers_info: Mapping[str, Any]) -> dict[str, Any] | None:
    """TrainingArguments kwargs selecting a sampling strategy; None where the version lacks it."""
    field = transformers_info.get("sampling_field")
    if strategy not in (transformers_info.get("sampling_strategies") or []):
        return None
    if field == SAMPLING_FIELD:
        return {SAMPLING_FIELD: strategy}
    if field == LEGACY_GROUP_FLAG:
        return {LEGACY_GROUP_FLAG: strategy == HF_GROUP_BY_LENGTH}
    return None


# --------------------------------------------------------------------------------------------
# Verification against the installed classes
# --------------------------------------------------------------------------------------------


def _cuda_bf16() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def verify_snippet(snippet: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Execute the snippet's imports and its ``args = ...`` line; read every kwarg back.

    A FutureWarning/DeprecationWarning raised while constructing fails the check (the pasted
    names must be the installed libraries' current ones). Checks what construction alone does
    not: a value outside a field's declared ``choices`` (TrainingArguments accepts
    ``train_sampling_strategy="bogus"`` silently). Without a CUDA bf16 device, SFTConfig's
    default ``bf16=True`` refuses to construct, so the classes get ``use_cpu=True`` added (said
    in the reason).
    """
    namespace: dict[str, Any] = {}
    note = ""
    try:
        exec("\n".join(snippet["imports"]), namespace)
        if not _cuda_bf16():
            note = "; constructed with use_cpu=True added (no CUDA bf16 device here)"
            for name in ("TrainingArguments", "SFTConfig"):
                if name in namespace:
                    namespace[name] = _with_use_cpu(namespace[name])
        with warnings.catch_warnings():
            # a setting the installed library deprecates is not a current name: refused
            for category in DEPRECATIONS:
                warnings.simplefilter("error", category)
            exec(snippet["args"], namespace)
    except Exception as error:  # any failure is the answer: report it, never crash the stage
        return {"verified": False, "reason": f"{type(error).__name__}: {error}"}
    args = namespace["args"]
    choices = _field_choices(type(args))
    problems = []
    for key, value in kwargs.items():
        if getattr(args, key, object()) != value:
            problems.append(f"{key}: set {value!r}, object has {getattr(args, key, None)!r}")
        allowed = choices.get(key)
        if allowed is not None and str(value) not in allowed:
            problems.append(f"{key}={value!r} is not one of {allowed}")
    if problems:
        return {"verified": False, "reason": "; ".join(problems)}
    return {
        "verified": True,
        "reason": f"constructed {type(args).__name__} from the snippet; every kwarg read back"
        + note,
    }


def _with_use_cpu(cls: type) -> Any:
    def build(*args: Any, **kwargs: Any) -> Any:
        return cls(*args, **{"use_cpu": True, **kwargs})

    return build


def verify_change(change: Mapping[str, Any]) -> dict[str, Any]:
    """Verification of every snippet of one change: {library: {verified, reason}}."""
    results: dict[str, Any] = {}
    for library, key in (("transformers", "training_arguments"), ("trl", "sft_config")):
        snippet = (change.get("snippets") or {}).get(library)
        kwargs = change.get(key)
        if snippet is None or kwargs is None:
            results[library] = {"verified": None, "reason": "no setting for this library"}
            continue
        module = "transformers" if library == "transformers" else "trl"
        try:
            __import__(module)
        except ImportError:
            results[library] = {"verified": False, "reason": f"{module} is not installed here"}
            continue
        results[library] = verify_snippet(snippet, kwargs)
    return results


def verify_document(document: dict[str, Any]) -> dict[str, Any]:
    """Adds ``verification`` and ``verified`` to every applicable change (in place; returned)."""
    for change in document["changes"]:
        if not change.get("applies"):
            continue
        results = verify_change(change)
        change["verification"] = results
        checked = [r["verified"] for r in results.values() if r["verified"] is not None]
        change["verified"] = bool(checked) and all(checked)
    return document
