"""The mask gate's positive control: a small reference architecture whose answers (window, fast
path, backends per scenario) are written down by hand; ``run_control`` must recover them.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from probes.mask import backend as sdpa_backend
from probes.mask.implementations import with_all_ones_mask
from probes.mask.layers import FULL, SLIDING
from probes.mask.scenarios import flattening_collator
from probes.mask.verdict import evaluate, make_target, merged_mask_config

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
    "cross_document_detected": True,
    "sdpa_by_rows_agrees_with_dense": True,
}
# query rows per block in that comparison: several blocks, the last one short, at T = 24
CONTROL_ROW_CHUNK = 5


def _first(table: pd.DataFrame, scenario: str, layer_type: str, column: str) -> Any:
    part = table[(table["scenario"] == scenario) & (table["layer_type"] == layer_type)]
    values = part[column].tolist()
    # every layer of the type must agree for the answer to be a single number
    if len({str(v) for v in values}) != 1:
        return f"differs across layers: {sorted({str(v) for v in values})}"
    value = values[0]
    return value.item() if hasattr(value, "item") else value


def cross_document_detected() -> bool:
    """The gate refuses packed documents that see each other: the packed row with an all-ones
    2-D attention_mask beside its restarting position ids, where transformers skips its
    packed-sequence detection (transformers#46634)."""
    leaky = with_all_ones_mask(flattening_collator())
    cfg = merged_mask_config({**CONTROL_MASK_CONFIG, "scenarios": ["packed"]})
    _, summary = evaluate(
        CONTROL_CONFIG, cfg, CONTROL_TRAINING, "control", progress=False, packed_collator=leaky
    )
    return summary["violations_total"] > 0


def by_rows_agrees_with_dense() -> bool:
    """SDPA's masks built a block of query rows at a time and the dispatch trace's one-row
    masks (probes.mask.shapes) give the rows transformers' own dense masks give: every column
    of the band trace, every dispatch column of the dispatch trace, on each control scenario,
    traced on the multimodal wrapper of the control's text model (so token_type_ids applies)."""
    from probes.mask.layers import (
        DISPATCH_COLUMNS,
        GateSettings,
        layer_specs,
        model_window,
        run_scenario,
    )
    from probes.mask.scenarios import build_scenarios
    from probes.mask.trace import build_probe_model

    cfg = merged_mask_config({**CONTROL_MASK_CONFIG, "scenarios": list(ROW_SCENARIOS)})
    settings = GateSettings(target=make_target(cfg), row_chunk=CONTROL_ROW_CHUNK)
    probe = build_probe_model(CONTROL_MULTIMODAL)
    specs = layer_specs(probe.text_config, probe.num_layers)
    scenarios, _ = build_scenarios(
        cfg, CONTROL_TRAINING, model_window(specs), probe.accepts_token_type_ids
    )
    for scenario in scenarios:
        dense = run_scenario(probe, scenario, specs, settings, "dense")
        if run_scenario(probe, scenario, specs, settings, "rows") != dense:
            return False
        dispatch = run_scenario(probe, scenario, specs, settings, None)
        for a, b in zip(dispatch, dense, strict=True):
            if any(a.get(k) != b.get(k) for k in DISPATCH_COLUMNS):
                return False
    return True


ROW_SCENARIOS = ("train", "right_padded", "left_padded", "packed", "token_type_ids")
CONTROL_MULTIMODAL: dict[str, Any] = {
    "model_type": "gemma3",
    "text_config": CONTROL_CONFIG,
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    },
    "mm_tokens_per_image": 4,
}


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
    observed["cross_document_detected"] = cross_document_detected()
    observed["sdpa_by_rows_agrees_with_dense"] = by_rows_agrees_with_dense()
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
            "hand-written answers; then the same model against a wrong window (9), and its "
            "packed row with an all-ones 2-D attention_mask (documents see each other), both of "
            "which the gate must reject; and SDPA's masks built by blocks of 5 query rows, and "
            "the dispatch trace's one-row masks, must give what the dense masks give."
        ),
        "expected": CONTROL_EXPECTED,
        "observed": observed,
        "mismatches": {k: {"expected": e, "observed": o} for k, (e, o) in mismatches.items()},
        "passed": not mismatches,
    }
