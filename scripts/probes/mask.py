"""The mask gate: band structure and SDPA fast path of every decoder layer, from config.json alone.

For each scenario (the training shape, sequence lengths around the sliding window, padded and
packed batches) the model's own forward is traced (see probes.mask_trace): every decoder layer's
call into scaled_dot_product_attention is recorded with the real mask tensor transformers built.
Each distinct mask is measured row by row (probes.mask_band) and compared with what the config
asks for: sliding layers see exactly their window, full layers are causal, padding and packed
documents stay apart. The SDPA backend each call gets on the target GPU is predicted from the
recorded arguments (probes.sdpa_backend) and, on a CUDA machine, confirmed by torch itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from probes import mask_band, sdpa_backend
from probes.config import fill_defaults, schema
from probes.errors import ProbeError
from probes.mask_memory import reuse_freed_memory
from probes.mask_trace import AttentionRecord, ProbeModel, build_probe_model, trace_attention

log = logging.getLogger("probes.mask")

SCENARIO_NAMES = (
    "train",
    "below_window",
    "at_window",
    "above_window",
    "right_padded",
    "left_padded",
    "packed",
    "token_type_ids",
)
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
    "attn_implementation": "string",  # sdpa | eager
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


# --- scenarios -----------------------------------------------------------------------------------


@dataclass
class Scenario:
    """One input batch: shapes plus where each document and padding sits."""

    name: str
    description: str
    doc_ids: np.ndarray  # (B, T): document index per position, -1 on padding
    padding: str = "none"  # none | right | left
    packed: bool = False
    token_type_ids: bool = False

    @property
    def batch(self) -> int:
        return int(self.doc_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.doc_ids.shape[1])

    @property
    def n_docs(self) -> int:
        return int(max(len(set(row[row >= 0].tolist())) for row in self.doc_ids))

    def key_is_pad(self) -> torch.Tensor:
        return torch.from_numpy(self.doc_ids < 0)

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """What a collator hands the model: ids, a 2-D padding mask or restarting position ids."""
        ids = torch.ones(self.batch, self.seq_len, dtype=torch.long)
        inputs: dict[str, torch.Tensor | None] = {"input_ids": ids}
        if self.packed:
            # DataCollatorWithFlattening: one row, position_ids restart per document, no mask
            starts = mask_band.document_starts(self.doc_ids)
            positions = np.arange(self.seq_len)[None, :] - starts
            inputs["position_ids"] = torch.from_numpy(positions.astype(np.int64))
        else:
            inputs["attention_mask"] = torch.from_numpy((self.doc_ids >= 0).astype(np.int64))
        if self.token_type_ids:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        return inputs


def _single_doc(batch: int, seq_len: int) -> np.ndarray:
    return np.zeros((batch, seq_len), dtype=np.int64)


def padded_doc_ids(lengths: list[int], seq_len: int, side: str) -> np.ndarray:
    doc_ids = np.full((len(lengths), seq_len), -1, dtype=np.int64)
    for row, length in enumerate(lengths):
        if side == "right":
            doc_ids[row, :length] = 0
        else:
            doc_ids[row, seq_len - length :] = 0
    return doc_ids


def packed_doc_ids(doc_lengths: list[int]) -> np.ndarray:
    return np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(doc_lengths)])[None]


def split_lengths(total: int, fractions: list[float]) -> list[int]:
    """Document lengths summing to `total`, in the given proportions (each at least 1)."""
    raw = [max(1, int(round(total * f / sum(fractions)))) for f in fractions]
    raw[-1] = total - sum(raw[:-1])
    if raw[-1] < 1:
        raise ValueError(f"cannot split {total} tokens into {len(fractions)} documents")
    return raw


def build_scenarios(
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    window: int | None,
    accepts_token_type_ids: bool,
) -> tuple[list[Scenario], list[str]]:
    """The scenarios asked for in mask.scenarios, and notes on the ones that do not apply."""
    batch = int(training_cfg["micro_batch_size"])
    seq_len = int(training_cfg["max_seq_len"])
    wanted = list(mask_cfg["scenarios"])
    notes: list[str] = []
    scenarios: list[Scenario] = []
    pad_batch = max(2, batch)
    pad_fraction = float(mask_cfg["pad_fraction"])
    pad_lengths = [seq_len] + [
        max(1, seq_len - int(round(pad_fraction * seq_len * i / (pad_batch - 1))))
        for i in range(1, pad_batch)
    ]
    for name in wanted:
        if name == "train":
            scenarios.append(
                Scenario(name, "the training shape, unpadded", _single_doc(batch, seq_len))
            )
        elif name in ("below_window", "at_window", "above_window"):
            if window is None:
                notes.append(f"scenario {name} skipped: the model has no sliding-window layer")
                continue
            length = {"below_window": window - 1, "at_window": window, "above_window": window + 1}[
                name
            ]
            if length < 2:
                notes.append(f"scenario {name} skipped: window {window} too small")
                continue
            scenarios.append(
                Scenario(name, f"T={length} against window {window}", _single_doc(1, length))
            )
        elif name in ("right_padded", "left_padded"):
            side = name.split("_")[0]
            scenarios.append(
                Scenario(
                    name,
                    f"{side}-padded batch, lengths {pad_lengths}",
                    padded_doc_ids(pad_lengths, seq_len, side),
                    padding=side,
                )
            )
        elif name == "packed":
            lengths = split_lengths(seq_len, list(mask_cfg["packed_doc_fractions"]))
            scenarios.append(
                Scenario(
                    name,
                    f"one packed row, documents {lengths}",
                    packed_doc_ids(lengths),
                    packed=True,
                )
            )
        elif name == "token_type_ids":
            if not accepts_token_type_ids:
                notes.append(
                    "scenario token_type_ids skipped: not a multimodal wrapper taking them"
                )
                continue
            scenarios.append(
                Scenario(
                    name,
                    "the training shape with all-text token_type_ids (a multimodal processor's)",
                    _single_doc(batch, seq_len),
                    token_type_ids=True,
                )
            )
        else:
            raise ValueError(f"config key mask.scenarios: unknown scenario '{name}'")
    return scenarios, notes


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


def _gqa_path(record: AttentionRecord) -> str:
    if record.q_heads == record.kv_heads:
        return "mha"
    if record.call is None:
        return "eager"
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
            result = sdpa_backend.confirm_with_torch(call, "cuda", settings.target.requires_grad)
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
    probe: ProbeModel, scenario: Scenario, specs: list[LayerSpec], settings: GateSettings
) -> list[dict[str, Any]]:
    """Trace one scenario and return one layers.parquet row per decoder layer."""
    mask_gib = scenario.batch * scenario.seq_len**2 / 2**30
    if mask_gib > settings.max_mask_gib:
        raise GateError(
            f"scenario '{scenario.name}': one dense mask of {scenario.batch}x{scenario.seq_len}^2 "
            f"is {mask_gib:.1f} GiB > mask.max_mask_gib={settings.max_mask_gib}; raise that limit "
            "if this machine has the memory"
        )
    records = trace_attention(probe, scenario.inputs())
    by_layer: dict[int, list[AttentionRecord]] = {}
    for record in records:
        by_layer.setdefault(record.layer_idx, []).append(record)
    key_is_pad = scenario.key_is_pad()
    n_docs = scenario.n_docs
    measured: dict[tuple, mask_band.RowIntervals] = {}  # per distinct mask (storage and view)
    rows = []
    for layer_idx, spec in enumerate(specs):
        layer_records = by_layer.get(layer_idx, [])
        row: dict[str, Any] = {
            "scenario": scenario.name,
            "batch": scenario.batch,
            "seq_len": scenario.seq_len,
            "padding": scenario.padding,
            "packed": scenario.packed,
            "n_docs": n_docs,
            "token_type_ids": scenario.token_type_ids,
            "layer_idx": layer_idx,
            "layer_type": spec.layer_type,
            "expected_window": spec.window,
            "attention_calls": len(layer_records),
        }
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
        call = record.call
        mask = record.mask
        if mask is not None and tuple(mask.shape[-2:]) != (scenario.seq_len, scenario.seq_len):
            raise GateError(
                f"layer {layer_idx} in scenario '{scenario.name}': mask shape "
                f"{tuple(mask.shape)} is not (..., {scenario.seq_len}, {scenario.seq_len}); "
                "the gate only measures square training masks"
            )
        row.update(
            attn_implementation=record.implementation,
            module_sliding_window=record.module_sliding_window,
            q_heads=record.q_heads,
            kv_heads=record.kv_heads,
            head_dim=record.head_dim,
            head_dim_v=call.head_dim_v if call else None,
            dtype=call.dtype if call else str(probe.dtype).removeprefix("torch."),
            mask_present=mask is not None,
            mask_shape="x".join(map(str, mask.shape)) if mask is not None else None,
            mask_dtype=str(mask.dtype).removeprefix("torch.") if mask is not None else None,
            is_causal=call.is_causal if call else False,
            enable_gqa=call.enable_gqa if call else False,
            gqa_path=_gqa_path(record),
        )
        row["fast_path"] = bool(call is not None and mask is None and call.is_causal)
        # band: measured from the mask tensor, or SDPA's own semantics when there is no mask
        if mask is not None:
            key = mask_identity(mask)
            if key not in measured:
                measured[key] = mask_band.row_intervals(mask, key_is_pad)
            intervals, band_source = measured[key], "mask"
        else:
            is_causal = bool(call.is_causal) if call else False
            intervals = mask_band.implied_intervals(
                scenario.batch, scenario.seq_len, scenario.seq_len, is_causal
            )
            band_source = "is_causal" if is_causal else "none"
        summary = mask_band.summarise(
            intervals, scenario.doc_ids, spec.window, check=spec.checkable
        )
        band_ok = (
            None
            if not spec.checkable
            else (
                summary.mismatched_rows == 0
                and summary.noncontiguous_rows == 0
                and summary.pad_keys_attended == 0
            )
        )
        row.update(
            band_source=band_source,
            band_lower=summary.band_lower,
            band_upper=summary.band_upper,
            keys_min=summary.keys_min,
            keys_max=summary.keys_max,
            blocks=summary.blocks,
            fully_masked_rows=summary.fully_masked_rows,
            pad_keys_attended=summary.pad_keys_attended,
            noncontiguous_rows=summary.noncontiguous_rows,
            mismatched_rows=summary.mismatched_rows,
            band_ok=band_ok,
            violation=None
            if band_ok in (True, None)
            else _violation_text(scenario, layer_idx, spec, summary, band_source),
        )
        # backend on the target GPU
        if call is None:
            row.update(
                backend=sdpa_backend.EAGER,
                excluded_by=f"model runs eager, not SDPA: {probe.sdpa_unsupported_reason}",
            )
        else:
            prediction = sdpa_backend.predict_backend(call, settings.target)
            row.update(backend=prediction.backend, excluded_by=prediction.excluded_by() or None)
            if settings.confirm and settings.confirm_target is not None:
                local = sdpa_backend.predict_backend(call, settings.confirm_target)
                confirmed = _confirm(call, settings)
                if confirmed.get("ran", True):
                    row.update(
                        local_predicted_backend=local.backend,
                        confirmed_backend=confirmed.get("backend"),
                        confirm_agrees=confirmed.get("backend") == local.backend,
                        confirm_can_use=str(confirmed.get("can_use")),
                    )
        rows.append(row)
    return rows


# --- the whole gate ------------------------------------------------------------------------------


def merged_mask_config(mask_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """The mask section with every missing key filled from the schema (the one home of defaults)."""
    return fill_defaults(dict(mask_cfg or {}), schema()["properties"]["mask"])


def make_target(mask_cfg: dict[str, Any]) -> sdpa_backend.Target:
    """The GPU and torch the prediction is for: mask.torch_version (default: the installed torch)
    with the cuDNN its wheel bundles unless mask.cudnn_version says otherwise."""
    return sdpa_backend.resolve_target(
        compute_capability=sdpa_backend.parse_compute_capability(
            mask_cfg["target_compute_capability"]
        ),
        torch_version=str(mask_cfg.get("torch_version") or torch.__version__),
        cudnn_version=mask_cfg.get("cudnn_version"),
        prefer_cudnn=mask_cfg.get("prefer_cudnn"),
        requires_grad=True,
    )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"config key mask.dtype: '{name}' is not a torch dtype (bfloat16, float16...)"
        )
    return dtype


def _config_value(config: Any, key: str) -> Any:
    # some configs (Gemma 4) refuse a global read of a per-layer attribute such as head_dim
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001
        return "per-layer"


def model_summary(probe: ProbeModel, specs: list[LayerSpec]) -> dict[str, Any]:
    text = probe.text_config
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.layer_type] = counts.get(spec.layer_type, 0) + 1
    return {
        "model_type": probe.config.model_type,
        "text_model_type": text.model_type,
        "architectures": getattr(probe.config, "architectures", None),
        "traced_class": type(probe.model).__name__,
        "num_layers": probe.num_layers,
        "layer_type_counts": counts,
        "sliding_window": _config_value(text, "sliding_window"),
        "num_attention_heads": _config_value(text, "num_attention_heads"),
        "num_key_value_heads": _config_value(text, "num_key_value_heads"),
        "head_dim": _config_value(text, "head_dim"),
        "hidden_size": _config_value(text, "hidden_size"),
        "attn_implementation": probe.attn_implementation,
        "sdpa_supported": probe.sdpa_supported,
    }


def evaluate(
    config_dict: dict[str, Any],
    mask_cfg: dict[str, Any],
    training_cfg: dict[str, Any],
    source: str = "config.json",
    progress: bool = True,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Trace every scenario and return (layers table, gate summary without the control)."""
    from tqdm import tqdm

    started = time.perf_counter()
    target = make_target(mask_cfg)
    probe = build_probe_model(config_dict, _dtype(mask_cfg["dtype"]), source)
    specs = layer_specs(
        probe.text_config, probe.num_layers, mask_cfg.get("expected_sliding_window")
    )
    scenarios, notes = build_scenarios(
        mask_cfg, training_cfg, model_window(specs), probe.accepts_token_type_ids
    )
    settings = GateSettings(target=target, max_mask_gib=float(mask_cfg["max_mask_gib"]))
    confirm_note = NOT_REQUESTED
    if mask_cfg.get("confirm_on_cuda"):
        if sdpa_backend.cuda_available():
            settings.confirm = True
            settings.confirm_target = sdpa_backend.local_target(requires_grad=True)
            confirm_note = "ran on this machine's CUDA device"
        else:
            confirm_note = sdpa_backend.NO_CUDA
    rows: list[dict[str, Any]] = []
    with reuse_freed_memory():
        for scenario in tqdm(scenarios, desc="mask scenarios", disable=not progress):
            scenario_start = time.perf_counter()
            rows.extend(run_scenario(probe, scenario, specs, settings))
            log.info(
                "scenario %s (B=%d, T=%d): %.2f s",
                scenario.name,
                scenario.batch,
                scenario.seq_len,
                time.perf_counter() - scenario_start,
            )
    table = layers_frame(rows)
    summary = summarise_gate(table, scenarios, probe, specs, target, training_cfg)
    summary["notes"] = probe.notes + notes
    summary["confirm"] = _confirm_summary(table, scenarios, settings, confirm_note)
    for entry in summary["scenarios"]:
        counts = summary["confirm"]["per_scenario"].get(entry["scenario"], {})
        entry["confirm_agreed"] = counts.get("agreed")
        entry["confirm_total"] = counts.get("total")
    if summary["confirm"]["status"] == CONFIRM_DISAGREED:
        summary["passed"] = False
    summary["trace_seconds"] = round(time.perf_counter() - started, 3)
    return table, summary


NOT_REQUESTED = "not requested (mask.confirm_on_cuda: false)"
CONFIRM_AGREED = "agreed"
CONFIRM_DISAGREED = "disagreed"


def _confirm_summary(
    table: pd.DataFrame, scenarios: list[Scenario], settings: GateSettings, note: str
) -> dict[str, Any]:
    """gate.json's "confirm": whether torch was asked, and agreed/total SDPA calls per scenario.

    status: "agreed" (every call torch was asked about matched the prediction), "disagreed",
    "not confirmed: no CUDA" or "not requested ...". per_scenario maps each scenario to
    {"agreed", "total"}; empty when confirmation did not run.
    """
    out: dict[str, Any] = {
        "ran": settings.confirm,
        "note": note,
        "status": note,
        "agreed": None,
        "total": None,
        "per_scenario": {},
    }
    if not settings.confirm:
        return out
    checked = table[table["confirm_agrees"].notna()]
    agrees = checked["confirm_agrees"].astype(bool)
    out["device_target"] = sdpa_backend.target_as_dict(settings.confirm_target)
    out["agreed"] = int(agrees.sum())
    out["total"] = int(len(checked))
    out["status"] = CONFIRM_AGREED if out["agreed"] == out["total"] else CONFIRM_DISAGREED
    for scenario in scenarios:
        part = agrees[checked["scenario"] == scenario.name]
        out["per_scenario"][scenario.name] = {"agreed": int(part.sum()), "total": int(len(part))}
    # kept for readers of the first H200 evidence
    out["calls_checked"], out["agree"] = out["total"], out["agreed"]
    disagree = checked[~agrees]
    out["disagreements"] = [
        f"{r.scenario} layer {r.layer_idx}: predicted {r.local_predicted_backend}, "
        f"torch chose {r.confirmed_backend}"
        for r in disagree.head(20).itertuples()
    ]
    return out


def summarise_gate(
    table: pd.DataFrame,
    scenarios: list[Scenario],
    probe: ProbeModel,
    specs: list[LayerSpec],
    target: sdpa_backend.Target,
    training_cfg: dict[str, Any],
) -> dict[str, Any]:
    """gate.json without the control: pass/fail, violations, fast-path counts, backend counts."""
    violations = [v for v in table.get("violation", pd.Series(dtype=object)).dropna().tolist()]
    per_scenario = []
    for scenario in scenarios:
        part = table[table["scenario"] == scenario.name]
        per_scenario.append(
            {
                "scenario": scenario.name,
                "description": scenario.description,
                "batch": scenario.batch,
                "seq_len": scenario.seq_len,
                "padding": scenario.padding,
                "packed": scenario.packed,
                "layers": int(len(part)),
                "layers_fast_path": int(part["fast_path"].sum()),
                "layers_with_mask": int(part["mask_present"].fillna(False).astype(bool).sum()),
                "backends": {str(k): int(v) for k, v in part["backend"].value_counts().items()},
                "violations": int(part["violation"].notna().sum()) if "violation" in part else 0,
            }
        )
    headline = None
    train = next((s for s in per_scenario if s["scenario"] == "train"), None)
    if train:
        headline = (
            f"{train['layers_fast_path']} of {train['layers']} decoder layers keep SDPA's "
            f"is_causal fast path at the training shape {train['batch']}x{train['seq_len']}"
        )
    return {
        "passed": not violations,
        "violations_total": len(violations),
        "violations": violations[:50],
        "headline": headline,
        "fast_path_at_training_shape": train,
        "scenarios": per_scenario,
        "model": model_summary(probe, specs),
        "target": sdpa_backend.target_as_dict(target),
        "training": {k: training_cfg.get(k) for k in ("micro_batch_size", "max_seq_len")},
    }


# --- positive control ----------------------------------------------------------------------------

CONTROL_WINDOW = 8
CONTROL_CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": CONTROL_WINDOW,
    "layer_types": [SLIDING] * 5 + [FULL],
    "max_position_embeddings": 256,
}
CONTROL_TRAINING = {"micro_batch_size": 2, "max_seq_len": 24}
CONTROL_MASK_CONFIG = {
    "scenarios": ["train", "right_padded", "packed"],
    "pad_fraction": 0.25,  # row 1 has 18 real tokens
    "packed_doc_fractions": [0.5, 0.3, 0.2],  # documents of 12, 7, 5 tokens
    "target_compute_capability": "9.0",
    # pinned: torch 2.10's wheel (cuDNN 9.10.2) keeps flash first, whatever torch is installed
    "torch_version": "2.10.0",
    "cudnn_version": None,
    "prefer_cudnn": None,
    "confirm_on_cuda": False,
}
# Known answers, written down by hand from the reference architecture: a window of 8 keys means a
# lower bandwidth of 7; the one full layer keeps the is_causal fast path on the unpadded batch;
# padding puts a mask on every layer; packing three documents gives three diagonal blocks; the
# full layer's band in the packed row reaches back 11 keys (the 12-token document).
CONTROL_EXPECTED: dict[str, Any] = {
    "train.sliding.band_lower": 7,
    "train.sliding.band_upper": 0,
    "train.sliding.keys_max": 8,
    "train.sliding.mask_present": True,
    "train.full.mask_present": False,
    "train.full.is_causal": True,
    "train.layers_fast_path": 1,
    "train.full.backend": sdpa_backend.FLASH,
    "train.sliding.backend": sdpa_backend.EFFICIENT,
    "right_padded.layers_with_mask": 6,
    "right_padded.pad_keys_attended": 0,
    "right_padded.full.band_lower": 23,
    "packed.layers_with_mask": 6,
    "packed.full.blocks": 3,
    "packed.full.band_lower": 11,
    "packed.sliding.band_lower": 7,
    "violations": 0,
    "wrong_window_detected": True,
}


def _first(table: pd.DataFrame, scenario: str, layer_type: str, column: str) -> Any:
    part = table[(table["scenario"] == scenario) & (table["layer_type"] == layer_type)]
    values = part[column].tolist()
    # every layer of the type must agree for the answer to be a single number
    if len({str(v) for v in values}) != 1:
        return f"differs across layers: {sorted({str(v) for v in values})}"
    value = values[0]
    return value.item() if hasattr(value, "item") else value


def run_control() -> dict[str, Any]:
    """Run the gate on a reference architecture whose answer is known, and on a wrong expectation.

    Returns the control.json dict {name, description, expected, observed, passed}.
    """
    mask_cfg = merged_mask_config(CONTROL_MASK_CONFIG)
    table, summary = evaluate(CONTROL_CONFIG, mask_cfg, CONTROL_TRAINING, "control", progress=False)
    by_scenario = {s["scenario"]: s for s in summary["scenarios"]}
    observed: dict[str, Any] = {
        "train.sliding.band_lower": _first(table, "train", SLIDING, "band_lower"),
        "train.sliding.band_upper": _first(table, "train", SLIDING, "band_upper"),
        "train.sliding.keys_max": _first(table, "train", SLIDING, "keys_max"),
        "train.sliding.mask_present": _first(table, "train", SLIDING, "mask_present"),
        "train.full.mask_present": _first(table, "train", FULL, "mask_present"),
        "train.full.is_causal": _first(table, "train", FULL, "is_causal"),
        "train.layers_fast_path": by_scenario["train"]["layers_fast_path"],
        "train.full.backend": _first(table, "train", FULL, "backend"),
        "train.sliding.backend": _first(table, "train", SLIDING, "backend"),
        "right_padded.layers_with_mask": by_scenario["right_padded"]["layers_with_mask"],
        "right_padded.pad_keys_attended": int(
            table.loc[table["scenario"] == "right_padded", "pad_keys_attended"].sum()
        ),
        "right_padded.full.band_lower": _first(table, "right_padded", FULL, "band_lower"),
        "packed.layers_with_mask": by_scenario["packed"]["layers_with_mask"],
        "packed.full.blocks": _first(table, "packed", FULL, "blocks"),
        "packed.full.band_lower": _first(table, "packed", FULL, "band_lower"),
        "packed.sliding.band_lower": _first(table, "packed", SLIDING, "band_lower"),
        "violations": summary["violations_total"],
    }
    # the gate must also be able to fail: the same architecture against a window one too wide
    wrong_cfg = merged_mask_config(
        {
            **CONTROL_MASK_CONFIG,
            "scenarios": ["train"],
            "expected_sliding_window": CONTROL_WINDOW + 1,
        }
    )
    _, wrong = evaluate(CONTROL_CONFIG, wrong_cfg, CONTROL_TRAINING, "control", progress=False)
    observed["wrong_window_detected"] = wrong["violations_total"] > 0
    mismatches = {
        k: (CONTROL_EXPECTED[k], observed.get(k))
        for k in CONTROL_EXPECTED
        if observed.get(k) != CONTROL_EXPECTED[k]
    }
    return {
        "name": "mask gate: tiny Gemma 3 with a known window",
        "description": (
            "A 6-layer Gemma 3 text config (5 sliding : 1 full, window 8, head_dim 32, GQA 4:2) "
            "traced at B=2, T=24 unpadded, right-padded and packed into 12+7+5 tokens, with "
            "hand-written answers; then the same model against a wrong window (9), which the "
            "gate must reject."
        ),
        "expected": CONTROL_EXPECTED,
        "observed": observed,
        "mismatches": {k: {"expected": e, "observed": o} for k, (e, o) in mismatches.items()},
        "passed": not mismatches,
    }


def run_gate(
    config_dict: dict[str, Any],
    mask_cfg: dict[str, Any] | None,
    training_cfg: dict[str, Any],
    source: str = "config.json",
    progress: bool = True,
) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Positive control first, then the user's model. Returns (layers, gate, control)."""
    started = time.perf_counter()
    control = run_control()
    log.info("positive control %s", "passed" if control["passed"] else "FAILED")
    if not control["passed"]:
        raise GateError(f"mask gate positive control failed: {control['mismatches']}")
    merged = merged_mask_config(mask_cfg)
    table, gate = evaluate(config_dict, merged, training_cfg, source, progress)
    confirm = gate["confirm"]
    if confirm["status"] == CONFIRM_DISAGREED and merged["fail_on_violation"]:
        per_scenario = ", ".join(
            f"{name} {c['agreed']}/{c['total']}" for name, c in confirm["per_scenario"].items()
        )
        raise GateError(
            f"SDPA backend prediction disagrees with torch on this GPU: {confirm['agreed']} of "
            f"{confirm['total']} calls agree ({per_scenario}); first: "
            f"{'; '.join(confirm['disagreements'][:3])}. The predictor's rules "
            "(probes.sdpa_backend) are out of date for this torch/cuDNN"
        )
    gate["control"] = {"name": control["name"], "passed": control["passed"]}
    gate["passed"] = bool(gate["passed"] and control["passed"])
    gate["wall_seconds"] = round(time.perf_counter() - started, 3)
    return table, gate, control
