"""One scenario, layer by layer: what each decoder layer's config asks for (LayerSpec), the trace of
its SDPA calls, the band of each distinct mask against that ask, the predicted (and, on CUDA,
confirmed) backend, and the rows of the layers table (LAYER_COLUMNS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from probes.errors import ProbeError
from probes.mask import backend as sdpa_backend
from probes.mask import band as mask_band
from probes.mask import confirm as sdpa_confirm
from probes.mask.scenarios import Scenario
from probes.mask.shapes import SdpaMasks, sdpa_masks_by_rows
from probes.mask.trace import AttentionRecord, ProbeModel, trace_attention

SLIDING = "sliding_attention"
FULL = "full_attention"

# layers.parquet: one row per scenario x decoder layer. Stable names: the report reads them.
LAYER_COLUMNS = {
    "scenario": "string",
    "batch": "Int64",
    "seq_len": "Int64",
    "padding": "string",  # none | right | left
    "packed": "boolean",
    "n_docs": "Int64",
    "token_type_ids": "boolean",
    "layer_idx": "Int64",
    "layer_type": "string",  # from config.layer_types (or sliding_window)
    "expected_window": "Int64",  # the window the gate asserts; null for full layers
    "attention_calls": "Int64",
    "attn_implementation": "string",  # sdpa | eager | flex_attention
    "module_sliding_window": "Int64",  # what the attention module passed on
    "q_heads": "Int64",
    "kv_heads": "Int64",
    "head_dim": "Int64",
    "head_dim_v": "Int64",
    "dtype": "string",
    "mask_present": "boolean",  # an explicit attn_mask reached SDPA
    "mask_shape": "string",
    "mask_dtype": "string",
    "is_causal": "boolean",  # the is_causal flag SDPA received
    "enable_gqa": "boolean",
    "gqa_path": "string",  # mha | enable_gqa | repeat_kv | eager
    "fast_path": "boolean",  # no mask and is_causal: SDPA's flash/cuDNN-friendly path
    "band_shape": "string",  # BxT the band columns were measured at (probes.mask.shapes)
    "band_source": "string",  # mask (measured) | is_causal | none (SDPA semantics, no mask)
    "band_lower": "Int64",  # max q - first allowed key over real rows (window - 1 when sliding)
    "band_upper": "Int64",  # max last allowed key - q (0 = causal)
    "keys_min": "Int64",
    "keys_max": "Int64",  # most keys any real row attends (= window when T > window)
    "blocks": "Int64",  # diagonal blocks (document starts), summed over the batch
    "fully_masked_rows": "Int64",  # rows, padding included, that attend nothing
    "pad_keys_attended": "Int64",  # (real query, padding key) pairs allowed: must be 0
    "noncontiguous_rows": "Int64",
    "mismatched_rows": "Int64",  # real rows whose key interval differs from the expected one
    "band_ok": "boolean",  # null when the layer type has no known pattern
    "violation": "string",
    "backend": "string",  # predicted on the target GPU: flash | cudnn | efficient | math | eager
    "excluded_by": "string",  # why each faster backend was excluded
    "local_predicted_backend": "string",  # prediction for this machine's GPU (CUDA only)
    "confirmed_backend": "string",  # torch._fused_sdp_choice on this machine's GPU (CUDA only)
    "confirm_agrees": "boolean",
    "confirm_can_use": "string",
}


def layers_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows as a table with the stable column set and nullable dtypes."""
    frame = pd.DataFrame(rows).reindex(columns=list(LAYER_COLUMNS))
    return frame.astype(LAYER_COLUMNS)


class GateError(ProbeError, RuntimeError):
    """The gate (or its positive control) failed; the message says where and what differed."""


# --- expectations per layer ----------------------------------------------------------------------


@dataclass
class LayerSpec:
    layer_type: str
    window: int | None  # the configured window of a sliding layer
    checkable: bool  # False for layer types whose pattern the gate does not know


def layer_specs(
    text_config: Any, num_layers: int, window_override: int | None = None
) -> list[LayerSpec]:
    """What each decoder layer should attend, read from the config (layer_types, sliding_window)."""
    window = getattr(text_config, "sliding_window", None)
    if window_override is not None:
        window = int(window_override)
    layer_types = getattr(text_config, "layer_types", None)
    if not layer_types:
        slides = (
            window is not None and getattr(text_config, "use_sliding_window", True) is not False
        )
        layer_types = [SLIDING if slides else FULL] * num_layers
    specs = []
    for layer_type in list(layer_types)[:num_layers]:
        if layer_type == SLIDING:
            specs.append(LayerSpec(layer_type, window, window is not None))
        elif layer_type == FULL:
            specs.append(LayerSpec(layer_type, None, True))
        else:
            specs.append(LayerSpec(layer_type, None, False))
    return specs


def model_window(specs: list[LayerSpec]) -> int | None:
    windows = {spec.window for spec in specs if spec.layer_type == SLIDING and spec.window}
    return min(windows) if windows else None


# --- one scenario --------------------------------------------------------------------------------


@dataclass
class GateSettings:
    target: sdpa_backend.Target
    confirm: bool = False
    confirm_target: sdpa_backend.Target | None = None
    max_mask_gib: float = 8.0
    confirm_cache: dict = field(default_factory=dict)
    row_chunk: int = mask_band.ROW_CHUNK  # query rows per block where masks are built by rows


def _gqa_path(record: AttentionRecord) -> str:
    if record.q_heads == record.kv_heads:
        return "mha"
    if record.call is None:
        return record.implementation  # eager / flex: no SDPA call
    if record.call.enable_gqa:
        return "enable_gqa"
    if record.call.k_shape[-3] == record.q_heads:
        return "repeat_kv"
    return "other"


def _violation_text(
    scenario: Scenario,
    layer_idx: int,
    spec: LayerSpec,
    summary: mask_band.BandSummary,
    band_source: str,
) -> str:
    what = []
    if summary.first_mismatch:
        what.append(summary.first_mismatch)
    if summary.noncontiguous_rows:
        what.append(f"{summary.noncontiguous_rows} rows attend a non-contiguous key set")
    if summary.pad_keys_attended:
        what.append(f"{summary.pad_keys_attended} (query, padding key) pairs allowed")
    window = f"window {spec.window}" if spec.window else "causal"
    source = "no mask, is_causal" if band_source == "is_causal" else band_source
    return (
        f"layer {layer_idx} ({spec.layer_type}, expected {window}) in scenario '{scenario.name}' "
        f"(B={scenario.batch}, T={scenario.seq_len}, padding={scenario.padding}, "
        f"packed={scenario.packed}; band from {source}): {'; '.join(what) or 'mismatch'}"
    )


def _confirm(call: sdpa_backend.SdpaCall, settings: GateSettings) -> dict[str, Any]:
    if call not in settings.confirm_cache:
        try:
            result = sdpa_confirm.confirm_with_torch(call, "cuda", settings.target.requires_grad)
        except Exception as error:  # noqa: BLE001 - a confirmation failure is reported, not fatal
            result = {"backend": None, "can_use": {}, "error": str(error).splitlines()[0][:200]}
        settings.confirm_cache[call] = result
    return settings.confirm_cache[call]


def mask_identity(mask: torch.Tensor) -> tuple:
    """Two masks with this key hold the same values: the same memory read the same way.

    Layers of one type get the same tensor from transformers' mask mapping; views of one storage
    (a slice, an expand) are recognised too, so each distinct mask is measured once.
    """
    return (
        mask.untyped_storage().data_ptr(),
        mask.storage_offset(),
        tuple(mask.shape),
        tuple(mask.stride()),
        mask.dtype,
    )


def run_scenario(
    probe: ProbeModel,
    scenario: Scenario,
    specs: list[LayerSpec],
    settings: GateSettings,
    band: str | None = "dense",
) -> list[dict[str, Any]]:
    """Trace one scenario and return one layers.parquet row per decoder layer. `band`: "dense"
    (the masks as transformers builds them, measured whole), "rows" (SDPA masks built and
    measured a block of query rows at a time, probes.mask.shapes) or None (a dispatch trace:
    the calls and backends, no band)."""
    if band == "dense":
        _check_mask_size(scenario, settings)
        records, masks = trace_attention(probe, scenario.inputs()), None
    else:
        with sdpa_masks_by_rows() as masks:
            records = trace_attention(probe, scenario.inputs())
    by_layer: dict[int, list[AttentionRecord]] = {}
    for record in records:
        by_layer.setdefault(record.layer_idx, []).append(record)
    measured = _Measured()
    rows = []
    for layer_idx, spec in enumerate(specs):
        layer_records = by_layer.get(layer_idx, [])
        row = _scenario_columns(scenario, layer_idx, spec, len(layer_records))
        if not layer_records:
            # a full or sliding layer that never called attention means the trace is broken
            missing = f"layer {layer_idx} ({spec.layer_type}) in scenario '{scenario.name}': "
            row.update(
                backend="none",
                fast_path=False,
                band_ok=False if spec.checkable else None,
                violation=missing + "no attention call recorded" if spec.checkable else None,
            )
            rows.append(row)
            continue
        record = layer_records[-1]
        row.update(_call_columns(probe, scenario, layer_idx, record))
        if band is not None:
            row.update(_band_columns(scenario, layer_idx, spec, record, measured, masks, settings))
        row.update(_backend_columns(probe, record, settings))
        rows.append(row)
    return rows


# what a dispatch trace at the training shape decides; the rest of a row is the band's
DISPATCH_COLUMNS = (
    "batch",
    "seq_len",
    "attention_calls",
    "attn_implementation",
    "module_sliding_window",
    "q_heads",
    "kv_heads",
    "head_dim",
    "head_dim_v",
    "dtype",
    "mask_present",
    "mask_shape",
    "mask_dtype",
    "is_causal",
    "enable_gqa",
    "gqa_path",
    "fast_path",
    "backend",
    "excluded_by",
    "local_predicted_backend",
    "confirmed_backend",
    "confirm_agrees",
    "confirm_can_use",
)


def merge_dispatch(
    dispatch: list[dict[str, Any]], band: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """One row per layer: the dispatch trace's columns (training shape) over the band trace's
    (semantic shape); None where a layer gets a mask at one shape and none at the other (its
    band then depends on the shape: the caller measures it at the training shape)."""
    merged = []
    for at_training, at_semantic in zip(dispatch, band, strict=True):
        if at_training.get("mask_present") != at_semantic.get("mask_present"):
            return None
        row = {**at_semantic, **{k: at_training.get(k) for k in DISPATCH_COLUMNS}}
        if at_training.get("violation"):  # no attention call recorded at the training shape
            row.update(band_ok=False, violation=at_training["violation"])
        merged.append(row)
    return merged


def _check_mask_size(scenario: Scenario, settings: GateSettings) -> None:
    mask_gib = scenario.batch * scenario.seq_len**2 / 2**30
    if mask_gib > settings.max_mask_gib:
        raise GateError(
            f"scenario '{scenario.name}': one dense mask of {scenario.batch}x{scenario.seq_len}^2 "
            f"is {mask_gib:.1f} GiB > mask.max_mask_gib={settings.max_mask_gib}; raise that limit "
            "if this machine has the memory"
        )


def _scenario_columns(
    scenario: Scenario, layer_idx: int, spec: LayerSpec, calls: int
) -> dict[str, Any]:
    """The row's scenario and layer, and what the layer's config asks for."""
    return {
        "scenario": scenario.name,
        "batch": scenario.batch,
        "seq_len": scenario.seq_len,
        "padding": scenario.padding,
        "packed": scenario.packed,
        "n_docs": scenario.n_docs,
        "token_type_ids": scenario.token_type_ids,
        "layer_idx": layer_idx,
        "layer_type": spec.layer_type,
        "expected_window": spec.window,
        "attention_calls": calls,
    }


def _call_columns(
    probe: ProbeModel, scenario: Scenario, layer_idx: int, record: AttentionRecord
) -> dict[str, Any]:
    """The layer's last attention call: implementation, heads, mask, SDPA arguments."""
    call, mask = record.call, record.mask
    if mask is not None and tuple(mask.shape[-2:]) != (scenario.seq_len, scenario.seq_len):
        raise GateError(
            f"layer {layer_idx} in scenario '{scenario.name}': mask shape "
            f"{tuple(mask.shape)} is not (..., {scenario.seq_len}, {scenario.seq_len}); "
            "the gate only measures square training masks"
        )
    return {
        "attn_implementation": record.implementation,
        "module_sliding_window": record.module_sliding_window,
        "q_heads": record.q_heads,
        "kv_heads": record.kv_heads,
        "head_dim": record.head_dim,
        "head_dim_v": call.head_dim_v if call else None,
        "dtype": call.dtype if call else str(probe.dtype).removeprefix("torch."),
        "mask_present": mask is not None,
        "mask_shape": "x".join(map(str, mask.shape)) if mask is not None else None,
        "mask_dtype": str(mask.dtype).removeprefix("torch.") if mask is not None else None,
        "is_causal": call.is_causal if call else False,
        "enable_gqa": call.enable_gqa if call else False,
        "gqa_path": _gqa_path(record),
        "fast_path": bool(call is not None and mask is None and call.is_causal),
    }


@dataclass
class _Measured:
    """One scenario's measurements: intervals per distinct mask (storage and view; "is_causal"
    and "none" for layers without one) and band summaries per (mask, expected window)."""

    intervals: dict[tuple, mask_band.RowIntervals] = field(default_factory=dict)
    summaries: dict[tuple, mask_band.BandSummary] = field(default_factory=dict)


def _band_columns(
    scenario: Scenario,
    layer_idx: int,
    spec: LayerSpec,
    record: AttentionRecord,
    measured: _Measured,
    masks: SdpaMasks | None = None,
    settings: GateSettings | None = None,
) -> dict[str, Any]:
    """The band: measured from the mask (once per distinct mask; by blocks of rows where
    `masks` built it), or SDPA's own semantics when there is no mask; checked against the
    layer's expected window."""
    call, mask = record.call, record.mask
    if mask is not None:
        key: tuple = mask_identity(mask)
        band_source = "mask"
    else:
        band_source = "is_causal" if call is not None and call.is_causal else "none"
        key = (band_source,)
    if key not in measured.intervals:
        measured.intervals[key] = (
            _intervals(mask, scenario, masks, settings.row_chunk if settings else None)
            if mask is not None
            else mask_band.implied_intervals(
                scenario.batch, scenario.seq_len, scenario.seq_len, band_source == "is_causal"
            )
        )
    # layers of one type share their mask and their expectation: summarised once
    expectation = (key, spec.window, spec.checkable)
    if expectation not in measured.summaries:
        measured.summaries[expectation] = mask_band.summarise(
            measured.intervals[key], scenario.doc_ids, spec.window, check=spec.checkable
        )
    summary = measured.summaries[expectation]
    band_ok = (
        None
        if not spec.checkable
        else (
            summary.mismatched_rows == 0
            and summary.noncontiguous_rows == 0
            and summary.pad_keys_attended == 0
        )
    )
    return {
        "band_shape": f"{scenario.batch}x{scenario.seq_len}",
        "band_source": band_source,
        "band_lower": summary.band_lower,
        "band_upper": summary.band_upper,
        "keys_min": summary.keys_min,
        "keys_max": summary.keys_max,
        "blocks": summary.blocks,
        "fully_masked_rows": summary.fully_masked_rows,
        "pad_keys_attended": summary.pad_keys_attended,
        "noncontiguous_rows": summary.noncontiguous_rows,
        "mismatched_rows": summary.mismatched_rows,
        "band_ok": band_ok,
        "violation": None
        if band_ok in (True, None)
        else _violation_text(scenario, layer_idx, spec, summary, band_source),
    }


def _intervals(
    mask: torch.Tensor, scenario: Scenario, masks: SdpaMasks | None, row_chunk: int | None
) -> mask_band.RowIntervals:
    arguments = masks.arguments_of(mask) if masks is not None else None
    if arguments is None:  # a mask as SDPA (or eager, flex) received it, values and all
        return mask_band.row_intervals(mask, scenario.key_is_pad())
    return mask_band.intervals_by_rows(
        lambda start, stop: masks.rows(arguments, start, stop),
        scenario.batch,
        scenario.seq_len,
        scenario.key_is_pad(),
        row_chunk or mask_band.ROW_CHUNK,
    )


def _backend_columns(
    probe: ProbeModel, record: AttentionRecord, settings: GateSettings
) -> dict[str, Any]:
    """The SDPA backend predicted for the target GPU, and its confirmation where asked."""
    call = record.call
    if call is None:
        why = probe.sdpa_unsupported_reason or f"attn_implementation {probe.attn_implementation}"
        backend = sdpa_backend.EAGER if record.implementation == "eager" else record.implementation
        return {"backend": backend, "excluded_by": f"model runs {backend}, not SDPA: {why}"}
    prediction = sdpa_backend.predict_backend(call, settings.target)
    columns = {"backend": prediction.backend, "excluded_by": prediction.excluded_by() or None}
    if settings.confirm and settings.confirm_target is not None:
        local = sdpa_backend.predict_backend(call, settings.confirm_target)
        confirmed = _confirm(call, settings)
        if confirmed.get("ran", True):
            columns.update(
                local_predicted_backend=local.backend,
                confirmed_backend=confirmed.get("backend"),
                confirm_agrees=confirmed.get("backend") == local.backend,
                confirm_can_use=str(confirmed.get("can_use")),
            )
    return columns
