"""The profile's records from what it measured: control.json (``control_record``, which also
marks MFU unverified where only the FLOP count failed), provenance.json (``profile_provenance``)
and the log's summary (``profile_summary``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from probes.errors import ControlFailedError
from probes.profile import flops as fl
from probes.profile.evidence import read_recommendation
from probes.profile.load import ProfiledStep
from probes.settings import ProfileConfig
from probes.step.cluster import slurm_environment
from probes.step.runner import Settings

LOG = logging.getLogger("probes.profile")


def control_record(controls: list[dict[str, Any]], provenance: dict[str, Any]) -> dict[str, Any]:
    """A control may guard one derived figure only (the FLOP count guards MFU): its failure
    marks that figure, not the stage. Raises when a control that gates the stage failed."""
    unverified = [c["mfu_unverified_reason"] for c in controls if c.get("mfu_unverified_reason")]
    provenance["mfu_verified"] = not unverified
    provenance["mfu_unverified_reason"] = unverified[0] if unverified else None
    if unverified:
        LOG.warning("MFU unverified: %s", unverified[0])
    passed = all(c["passed"] for c in controls if c.get("gates_stage", True))
    if not passed:
        failed = [c["name"] for c in controls if not c["passed"] and c.get("gates_stage", True)]
        observed = [c["observed"] for c in controls]
        raise ControlFailedError(f"control(s) failed: {failed}: {observed}")
    return {
        "name": "profile_controls",
        "description": (
            "the scaling fit recovers known coefficients; the analytic FLOP count matches "
            "FlopCounterMode on a real step; kernel sum <= profiled wall"
        ),
        "expected": {c["name"]: c["expected"] for c in controls},
        "observed": {c["name"]: c["observed"] for c in controls},
        "passed": passed,
        "mfu_verified": provenance["mfu_verified"],
        "mfu_unverified_reason": provenance["mfu_unverified_reason"],
        "checks": controls,
    }


def profile_provenance(
    step: ProfiledStep,
    settings: Settings,
    profile: ProfileConfig,
    run: dict[str, Any],
    model_path: str | Path,
    recommendation_path: str | Path | None,
    *,
    idle: Any,
    device: dict[str, Any],
    beyond_note: str | None,
    probe_length: int,
    measured: bool,
    loss: tuple[float, str],
    peak: tuple[Any, str],
) -> dict[str, Any]:
    """What the profile ran, on what, by which convention (provenance.json; one table)."""
    return {
        "device": device,
        "cpu_only": settings.cpu_only,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "dtype_reason": settings.dtype_reason,
        "attn_implementation": profile.attn_implementation,
        "lengths": settings.lengths,
        "lengths_note": beyond_note,
        "warmup": settings.warmup,
        "warmup_scope": "every timing (each is a new shape: probes.step.timing.ShapesRun)",
        "repeats": settings.repeats,
        "kernel_steps": settings.kernel_steps,
        "probe_length": probe_length,
        "probe_step_time_source": "measured" if measured else "fit",
        "micro_batch_size": settings.micro_batch,
        "loss_fraction": loss[0],
        "loss_fraction_source": loss[1],
        "model_path": str(model_path),
        "params": step.params,
        "trainable_params": step.trainable,
        "step_parameters": step.flop_model.params.as_dict(),
        "lm_head_positions": step.flop_model.head_positions,
        "has_experts": step.has_experts,
        "peak_tflops": peak[0],
        "peak_tflops_source": peak[1],
        "mfu_convention": fl.MFU_CONVENTION,
        "harness": step.described,
        "idle_check": idle,
        "slurm": slurm_environment(),
        "bucket_recommendation": read_recommendation(recommendation_path),
        "versions": run["versions"],
        "run": run,
    }


def profile_summary(device_info, settings, scaling, fit, penalty, ce, kernels) -> dict[str, Any]:
    """The log's summary of the stage."""
    return {
        "device": device_info["name"],
        "cpu_only": settings.cpu_only,
        "scaling": scaling[["seq_len", "status", "time_s", "mfu"]].to_dict("records"),
        "fit": {"a": fit.a, "b": fit.b, "c": fit.c, "method": fit.method},
        "padding_penalty": penalty[
            ["variant", "measured_penalty", "measured_penalty_min", "measured_penalty_max"]
        ].to_dict("records"),
        "ce": ce[["variant", "status", "time_s", "step_share"]].to_dict("records"),
        "kernel_sum_s": float(kernels["device_time_s"].sum()),
        "kernel_wall_s": float(kernels["wall_s"].iloc[0]) if len(kernels) else float("nan"),
    }
