"""The profile's provenance and evidence text: the device description, the informational
recommendation, and the plain-text summary written beside the tables.
"""

from __future__ import annotations

import logging
import math
import os
import platform
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from probes.io import read_json
from probes.profile import flops as fl
from probes.settings import WorkflowConfig
from probes.step.fit import QuadraticFit

LOG = logging.getLogger("probes.profile")


# ---------------------------------------------------------------------------------------------
# Provenance and the evidence text
# ---------------------------------------------------------------------------------------------


def timed_run_provenance(
    cfg: WorkflowConfig,
    device: torch.device,
    cpu_only: bool,
    dtype: tuple[str, str],
    max_len: int,
    harness: dict[str, Any],
    idle: Any,
    started: float,
    **extra: Any,
) -> dict[str, Any]:
    """What a timing stage (replay, realize) ran, on what: each table's metadata, `extra`
    beside it."""
    import os
    import time

    from probes.io import run_metadata

    return {
        # the whole config as a dict: run_metadata hashes it for the provenance
        **run_metadata(dict(cfg.raw)),
        "device": device_description(device),
        "cpu_only": cpu_only,
        "dtype": str(dtype[0]).replace("torch.", ""),
        "dtype_reason": dtype[1],
        "max_seq_len_replayed": max_len,
        "harness": harness,
        **extra,
        "idle_check": idle,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "wall_s": time.perf_counter() - started,
    }


def device_description(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_total_bytes": int(props.total_memory),
            "device_count": torch.cuda.device_count(),
            "cuda_runtime": torch.version.cuda,
        }
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "type": "cpu",
        "name": name,
        "capability": None,
        "memory_total_bytes": None,
        "threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def read_recommendation(path: str | Path | None) -> dict[str, Any] | None:
    if not path or not Path(path).is_file():
        return None
    try:
        rec = read_json(path)
    except ValueError:
        LOG.warning("%s: not valid JSON; ignored (informational only)", path)
        return None
    if not isinstance(rec, dict):
        return None

    def scalar(value: Any) -> bool:
        return isinstance(value, (int, float, str, bool)) or value is None

    # informational: top-level scalars and one level of scalar-only objects (e.g. batch shapes)
    return {
        key: value
        for key, value in rec.items()
        if scalar(value) or (isinstance(value, dict) and all(scalar(v) for v in value.values()))
    }


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def timed_step_line(described: dict[str, Any]) -> str:
    """Which step was timed: the harness and its functions, or the user's trainer."""
    if described.get("kind") == "trainer":
        factory = described.get("factory") or {}
        return (
            f"trainer: {described['trainer']} ({described['trainer_module']}) from "
            f"{factory.get('spec')}, collator {described['collator']}, "
            f"settings {described['settings']}"
        )
    return f"harness: {described['spec']} -> {described['functions']}"


def evidence_text(
    provenance: dict[str, Any],
    scaling: pd.DataFrame,
    fit: QuadraticFit,
    penalty: pd.DataFrame,
    ce: pd.DataFrame,
    kernels: pd.DataFrame,
    raw_table: str,
    controls: list[dict[str, Any]],
) -> str:
    """profile-output.txt: the run's raw evidence, numbers only (no data text ever)."""
    sections = [
        header_lines(provenance),
        scaling_lines(scaling),
        fit_lines(fit),
        penalty_lines(penalty),
        ce_lines(ce),
        kernel_lines(kernels),
        control_lines(controls),
        [f"MFU convention: {fl.MFU_CONVENTION}"],
        [raw_table],
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def header_lines(provenance: dict[str, Any]) -> list[str]:
    """The device, the timed step, the settings and the run."""
    device = provenance["device"]
    return [
        "# probes profile: raw evidence",
        f"device: {device['name']} ({device['type']})"
        + (" CPU-ONLY RUN" if provenance["cpu_only"] else ""),
        timed_step_line(provenance["harness"]),
        f"dtype {provenance['dtype']}, attention {provenance['attn_implementation']}, "
        f"micro-batch {provenance['micro_batch_size']}, active params "
        f"{provenance['params']['active_params']:,}, trainable {provenance['trainable_params']:,}",
        f"date {provenance['run']['date']}, commit {provenance['run']['git_commit']}",
    ]


def scaling_lines(scaling: pd.DataFrame) -> list[str]:
    lines = ["## scaling (time = median of repeats, forward + backward + optimizer step)"]
    for r in scaling.itertuples():
        lines.append(
            f"  {r.batch} x {r.seq_len:6d}: {r.status:3s} t={_fmt(r.time_s)} s "
            f"(std {_fmt(r.time_std_s)}), peak {_fmt(r.peak_mem_bytes / 2**30, '.2f')} GiB, "
            f"quadratic share {_fmt(r.quadratic_share, '.3f')}, MFU {_fmt(r.mfu, '.3f')} "
            f"(dense 6N reading {_fmt(r.mfu_dense_6n, '.3f')})"
        )
    return lines


def fit_lines(fit: QuadraticFit) -> list[str]:
    return [
        f"## fit t(T) = a T^2 + b T + c ({fit.method}, {fit.n_points} points)",
        f"  a={_fmt(fit.a)} s/token^2  b={_fmt(fit.b)} s/token  c={_fmt(fit.c)} s",
        f"  condition number (column-scaled) {_fmt(fit.condition_number)}, residual rms "
        f"{_fmt(fit.residual_rms_s)} s, max relative residual {_fmt(fit.max_rel_residual)}",
        f"  {fit.message}",
    ]


def penalty_lines(penalty: pd.DataFrame) -> list[str]:
    """The padding penalty per variant, then the first pick's batches as example ids only."""
    lines = [
        "## padding penalty (same examples, ids only; medians over the batches, spread min-max)"
    ]
    for r in penalty.itertuples():
        lines.append(
            f"  padded {_fmt(r.padded_time_s)} s vs {r.variant} {_fmt(r.unpadded_time_s)} s: "
            f"measured penalty {_fmt(r.measured_penalty, '.3f')} "
            f"[{_fmt(r.measured_penalty_min, '.3f')}, {_fmt(r.measured_penalty_max, '.3f')}] over "
            f"{r.n_batches} batch(es), fit-predicted {_fmt(r.predicted_penalty, '.3f')} "
            f"(longest {r.longest}, median waste {_fmt(r.padding_waste, '.3f')})"
        )
    if len(penalty) and "batch_example_ids" in penalty:
        first = penalty.iloc[0]
        lines.append(f"  {first['pick']}")
        for ids, lengths in zip(
            first["batch_example_ids"], first["batch_example_lengths"], strict=True
        ):
            lines.append(f"  batch: example ids {list(ids)}, lengths {list(lengths)}")
    return lines


def ce_lines(ce: pd.DataFrame) -> list[str]:
    lines = ["## LM head + cross-entropy (forward + backward on real hidden states)"]
    for r in ce.itertuples():
        lines.append(
            f"  {r.variant:24s} {r.status:7s} t={_fmt(r.time_s)} s, share of step "
            f"{_fmt(r.step_share, '.3f')}, chunk "
            f"{r.chunk_tokens if pd.notna(r.chunk_tokens) else '-'}, peak "
            f"{_fmt(r.peak_mem_bytes / 2**30, '.2f')} GiB [{r.source}]"
        )
    return lines


def kernel_lines(kernels: pd.DataFrame) -> list[str]:
    lines = ["## kernel categories"]
    for r in kernels.itertuples():
        lines.append(
            f"  {r.category:22s} {r.device_time_s:10.4f} s  share {r.share:.3f}  "
            f"of wall {r.share_of_wall:.3f}  ({r.n_kernels} kernels)"
        )
    return lines


def control_lines(controls: list[dict[str, Any]]) -> list[str]:
    """Each control passed or failed; the FLOP control's ratios beside it."""
    lines = ["## controls"]
    for control in controls:
        lines.append(f"  {control['name']}: {'PASSED' if control['passed'] else 'FAILED'}")
        if control["name"] == "analytic_flops_match_flop_counter":
            observed = control["observed"]
            lines.append(
                f"    analytic / counted linear FLOPs {_fmt(observed['analytic_over_counted'])} "
                f"(old 6N formula / counted total {_fmt(observed['old_6n_over_counted_total'])})"
            )
    return lines
