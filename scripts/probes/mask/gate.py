"""The mask gate: band structure and SDPA fast path of every decoder layer, from config.json alone.

For each scenario (the training shape, sequence lengths around the sliding window, padded and
packed batches) the model's own forward is traced (see probes.mask.trace): every decoder layer's
call into scaled_dot_product_attention is recorded with the mask transformers built. Each
distinct mask is measured row by row (probes.mask.band) and compared with what the config asks
for: sliding layers see exactly their window, full layers are causal, padding and packed
documents stay apart. Each check runs at the shape its answer depends on (probes.mask.shapes):
the mask skip and backend at the training shape, the padded and packed bands at the shortest
shape that relates to the window as the training shape does. The SDPA backend each call gets on
the target GPU is predicted from the recorded arguments (probes.mask.backend) and, on a CUDA
machine, confirmed by torch itself. Then every attention implementation a step-level change
proposes is traced the same way (probes.mask.implementations): its verdict decides whether
padding-free may use it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pandas as pd

from probes.mask.control import run_control
from probes.mask.implementations import check_implementations
from probes.mask.layers import GateError
from probes.mask.trace import build_probe_model
from probes.mask.verdict import CONFIRM_DISAGREED, evaluate, merged_mask_config, model_dtype

log = logging.getLogger("probes.mask.gate")


def run_gate(
    config_dict: dict[str, Any],
    mask_cfg: dict[str, Any] | None,
    training_cfg: dict[str, Any],
    source: str = "config.json",
    progress: bool = True,
) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Positive control first, then the user's model, then every attention implementation a
    change proposes (probes.mask.implementations, into the gate's ``implementations``). Returns
    (layers, gate, control)."""
    started = time.perf_counter()
    control = run_control()
    log.info("positive control %s", "passed" if control["passed"] else "FAILED")
    if not control["passed"]:
        raise GateError(f"mask gate positive control failed: {control['mismatches']}")
    merged = merged_mask_config(mask_cfg)
    probe = build_probe_model(config_dict, model_dtype(merged["dtype"]), source)
    table, gate = evaluate(config_dict, merged, training_cfg, source, progress, probe=probe)
    confirm = gate["confirm"]
    if confirm["status"] == CONFIRM_DISAGREED and merged["fail_on_violation"]:
        per_scenario = ", ".join(
            f"{name} {c['agreed']}/{c['total']}" for name, c in confirm["per_scenario"].items()
        )
        raise GateError(
            f"SDPA backend prediction disagrees with torch on this GPU: {confirm['agreed']} of "
            f"{confirm['total']} calls agree ({per_scenario}); first: "
            f"{'; '.join(confirm['disagreements'][:3])}. The predictor's rules "
            "(probes.mask.backend) are out of date for this torch/cuDNN"
        )
    primary = (str(gate["model"]["attn_implementation"]), table)
    gate["implementations"] = check_implementations(
        config_dict, merged, training_cfg, primary, source, probe=probe
    )
    gate["control"] = {"name": control["name"], "passed": control["passed"]}
    gate["passed"] = bool(gate["passed"] and control["passed"])
    gate["wall_seconds"] = round(time.perf_counter() - started, 3)
    return table, gate, control
