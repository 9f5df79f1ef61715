"""The gate over a model: every scenario traced (``evaluate``) and summarised into a verdict, the
model's attention facts, the target GPU the prediction is for, and the summary of the
confirmation against torch's own choice on a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pandas as pd
import torch
from tqdm import tqdm

from probes.config import fill_defaults, schema
from probes.mask import backend as sdpa_backend
from probes.mask import confirm as sdpa_confirm
from probes.mask.layers import (
    GateSettings,
    LayerSpec,
    layer_specs,
    layers_frame,
    merge_dispatch,
    model_window,
    run_scenario,
)
from probes.mask.memory import reuse_freed_memory
from probes.mask.scenarios import Collate, Scenario, build_scenarios
from probes.mask.shapes import REDUCIBLE, plan_shapes
from probes.mask.trace import ProbeModel, build_probe_model

log = logging.getLogger("probes.mask.gate")


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


def model_dtype(name: str) -> torch.dtype:
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
    attn_implementation: str | None = None,
    packed_collator: Collate | None = None,
    probe: ProbeModel | None = None,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Trace every scenario and return (layers table, gate summary without the control).

    `attn_implementation`: the model's (None: SDPA, or eager where SDPA is refused);
    `packed_collator`: what lays out the packed scenario (None: transformers' flattening one);
    `probe`: the model already built (probes.mask.trace.implementation_of). Bands are measured
    at the shapes probes.mask.shapes plans, SDPA's dispatch at the training shape."""
    started = time.perf_counter()
    target = make_target(mask_cfg)
    if probe is None:
        probe = build_probe_model(
            config_dict, model_dtype(mask_cfg["dtype"]), source, attn_implementation
        )
    specs = layer_specs(
        probe.text_config, probe.num_layers, mask_cfg.get("expected_sliding_window")
    )
    window = model_window(specs)
    plan = plan_shapes(mask_cfg, training_cfg, window)
    build = (mask_cfg, training_cfg, window, probe.accepts_token_type_ids, packed_collator)
    scenarios, notes = build_scenarios(*build)
    semantic = scenarios
    if plan.reduced:
        semantic, _ = build_scenarios(
            mask_cfg,
            {**training_cfg, "max_seq_len": plan.semantic_seq_len},
            *build[2:],
        )
    settings, confirm_note = _settings(mask_cfg, target)
    rows: list[dict[str, Any]] = []
    with reuse_freed_memory():
        for scenario, small in tqdm(
            list(zip(scenarios, semantic, strict=True)),
            desc="mask scenarios",
            disable=not progress,
        ):
            scenario_start = time.perf_counter()
            rows.extend(trace_scenario(probe, scenario, small, specs, settings))
            log.info(
                "scenario %s (%s): %.2f s",
                scenario.name,
                _shapes_text(rows[-1]),
                time.perf_counter() - scenario_start,
            )
    table = layers_frame(rows)
    summary = summarise_gate(table, scenarios, probe, specs, target, training_cfg)
    summary["shapes"] = plan.as_dict()
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


def _shapes_text(row: dict[str, Any]) -> str:
    dispatch = f"{row['batch']}x{row['seq_len']}"
    band = row.get("band_shape") or dispatch
    return f"B x T {dispatch}" if band == dispatch else f"dispatch {dispatch}, band {band}"


def _settings(mask_cfg: dict[str, Any], target: sdpa_backend.Target) -> tuple[GateSettings, str]:
    """The per-scenario settings, with the CUDA confirmation where asked and possible."""
    settings = GateSettings(target=target, max_mask_gib=float(mask_cfg["max_mask_gib"]))
    confirm_note = NOT_REQUESTED
    if mask_cfg.get("confirm_on_cuda"):
        if sdpa_confirm.cuda_available():
            settings.confirm = True
            settings.confirm_target = sdpa_confirm.local_target(requires_grad=True)
            confirm_note = "ran on this machine's CUDA device"
        else:
            confirm_note = sdpa_confirm.NO_CUDA
    return settings, confirm_note


def trace_scenario(
    probe: ProbeModel,
    scenario: Scenario,
    semantic: Scenario,
    specs: list[LayerSpec],
    settings: GateSettings,
) -> list[dict[str, Any]]:
    """One scenario's rows. At one shape: traced once. Else its band at the semantic shape and,
    under SDPA (whose mask skip and backend depend on T), its dispatch at the training shape;
    the band at the training shape after all where a layer's mask comes and goes with T.
    SDPA's masks are measured a block of rows at a time (probes.mask.shapes), the others'
    as transformers hands them over."""
    sdpa = probe.attn_implementation == "sdpa"
    reader = "rows" if sdpa else "dense"
    if semantic.seq_len == scenario.seq_len or scenario.name not in REDUCIBLE:
        return run_scenario(probe, scenario, specs, settings, reader)
    if not sdpa:  # eager and flex: a mask on every layer and no backend, at any T
        return run_scenario(probe, semantic, specs, settings, reader)
    # the backend (and torch's confirmation on CUDA) comes from the training shape's trace
    band = run_scenario(
        probe, semantic, specs, dataclasses.replace(settings, confirm=False), reader
    )
    dispatch = run_scenario(probe, scenario, specs, settings, band=None)
    merged = merge_dispatch(dispatch, band)
    if merged is None:
        log.info(
            "scenario %s: a mask comes and goes with T; band at the training shape", scenario.name
        )
        return run_scenario(probe, scenario, specs, settings, reader)
    return merged


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
        batch, seq_len = int(part["batch"].iloc[0]), int(part["seq_len"].iloc[0])
        per_scenario.append(
            {
                "scenario": scenario.name,
                "description": scenario.description,
                "batch": batch,
                "seq_len": seq_len,
                # where each verdict was checked: the mask skip and backend, and the band
                "dispatch_shape": f"{batch}x{seq_len}",
                "band_shape": str(part["band_shape"].dropna().iloc[0])
                if part["band_shape"].notna().any()
                else f"{batch}x{seq_len}",
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
