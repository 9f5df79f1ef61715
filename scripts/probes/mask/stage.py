"""The mask stage: per decoder layer, the mask band and the SDPA backend, and per attention
implementation whether documents stay apart, from config.json alone."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from probes.errors import ProbeError
from probes.io import run_metadata
from probes.mask.gate import run_gate
from probes.mask.trace import read_config_json
from probes.settings import WorkflowConfig, as_dict
from probes.stage import all_or_nothing

LOG = logging.getLogger("probes.mask.gate")


class GateFailedError(ProbeError):
    """Some layer/scenario pairs differ from the configured pattern (mask.fail_on_violation)."""


def run(inputs: Mapping[str, Any], outputs: Mapping[str, str], cfg: WorkflowConfig) -> None:
    model_config = str(inputs["model_config"])
    layers, gate, control = run_gate(
        read_config_json(model_config),
        as_dict(cfg.mask),
        as_dict(cfg.training),
        source=model_config,
    )
    log_gate(gate)
    if not gate["passed"]:
        for violation in gate["violations"]:
            LOG.error("violation: %s", violation)
        message = (
            f"mask gate FAILED: {gate['violations_total']} layer/scenario pairs differ from the "
            f"configured pattern (first: {gate['violations'][0] if gate['violations'] else '-'})"
        )
        if cfg.mask.fail_on_violation:
            raise GateFailedError(message)
        LOG.error("%s; outputs written anyway (mask.fail_on_violation: false)", message)
    provenance = run_metadata(dict(cfg.raw))
    gate["model_config"] = model_config
    gate["provenance"] = provenance
    with all_or_nothing(outputs) as out:
        out.parquet("layers", layers, provenance)
        out.json("control", control)
        out.json("gate", gate)
    LOG.info(
        "mask gate %s in %.1f s", "passed" if gate["passed"] else "FAILED", gate["wall_seconds"]
    )


def log_gate(gate: Mapping[str, Any]) -> None:
    LOG.info("%s", gate["headline"] or "no training-shape scenario")
    shapes = gate["shapes"]
    LOG.info(
        "shapes: training %s, semantic %s (%s)",
        *(shapes[k] for k in ("training", "semantic", "reason")),
    )
    for scenario in gate["scenarios"]:
        LOG.info(
            "scenario %-15s fast path %d/%d and backends %s at %s, band at %s, violations %d",
            scenario["scenario"],
            scenario["layers_fast_path"],
            scenario["layers"],
            scenario["backends"],
            scenario["dispatch_shape"],
            scenario["band_shape"],
            scenario["violations"],
        )
    for name, verdict in gate.get("implementations", {}).items():
        at = sorted({s["checked_at"] for s in verdict["per_scenario"]})
        LOG.info(
            "attention %-18s %s%s%s", name, verdict["status"],
            f" at {', '.join(at)}" if at else "",
            f": {verdict['violation'] or verdict['reason']}"
            if verdict["violation"] or verdict["reason"] else "",
        )  # fmt: skip
    for note in gate["notes"]:
        LOG.info("note: %s", note)
    LOG.info("confirmation: %s", gate["confirm"]["note"])
