"""The report's sections on the profile: scaling (with the padding penalty), cross-entropy (the
padding stage's chunk sizes beside the profile's timed variants) and kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.report.findings import fit_problem
from probes.report.format import finite
from probes.report.sections.common import _device_name, _not_run, _records, stage_text


def scaling_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    provenance = jsons["profile_provenance"]
    scaling = tables["profile_scaling"].sort_values("seq_len")
    fit = tables["profile_fit"]
    ok = scaling["status"] == "OK"
    return {
        "status": "ok",
        "cpu_only": bool(provenance.get("cpu_only")),
        "device": _device_name(provenance.get("device")),
        # probes.step.dtype: the dtype the profile ran in and why (provenance.json)
        "dtype": provenance.get("dtype"),
        "dtype_reason": provenance.get("dtype_reason"),
        # probes.profile.flops.MFU_CONVENTION: how the `mfu` column counts model FLOPs
        "mfu_convention": provenance.get("mfu_convention"),
        # probes.profile.flops.mfu_unverified_reason: the FLOP counter did not confirm the count
        "mfu_unverified_reason": provenance.get("mfu_unverified_reason"),
        "points": _records(scaling, table_columns("profile_scaling")),
        "n_ok": int(ok.sum()),
        "n_failed": int((~ok).sum()),
        "fit": _records(fit, table_columns("profile_fit"))[0] if not fit.empty else None,
        "fit_usable": fit_problem(tables, not_run) is None,
        "fit_problem": fit_problem(tables, not_run),
        "max_fitted_len": finite(scaling.loc[ok, "seq_len"].max()),
        "penalty": _records(
            tables["profile_padding_penalty"], table_columns("profile_padding_penalty")
        ),
    }


CE_ALL_UNCHUNKED = "all_positions_unchunked"
CE_LOSS_UNCHUNKED = "loss_positions_unchunked"
CE_LOSS_CHUNKED = "loss_positions_chunked"


def _effect(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict | None:
    """One change between two CE variants: both times, the time saved and after/before."""
    if before is None or after is None:
        return None
    t0, t1 = finite(before.get("time_s")), finite(after.get("time_s"))
    if t0 is None or t1 is None or t0 <= 0:
        return None
    return {"before_s": t0, "after_s": t1, "saved_s": t0 - t1, "ratio": t1 / t0}


def ce_effects(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict | None]:
    """The CE variants' two effects apart: position selection (all positions → loss positions,
    both unchunked) and chunking (loss positions unchunked → chunked). None where a variant
    did not run or failed (e.g. OOM)."""
    by_variant = {row["variant"]: row for row in rows if row.get("status") == "OK"}
    return {
        "position_selection": _effect(
            by_variant.get(CE_ALL_UNCHUNKED), by_variant.get(CE_LOSS_UNCHUNKED)
        ),
        "chunking": _effect(by_variant.get(CE_LOSS_UNCHUNKED), by_variant.get(CE_LOSS_CHUNKED)),
    }


def ce_section(tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str]) -> dict[str, Any]:
    if "padding" in not_run:
        chunks = _not_run(not_run["padding"])
    else:
        frame = tables["padding_ce_chunks"]
        chunks = {
            "status": "ok",
            "rows": _records(frame, table_columns("padding_ce_chunks")),
            "budget_gib": finite(frame["budget_gib"].iloc[0]) if "budget_gib" in frame else None,
        }
    if "profile" in not_run:
        wall = _not_run(not_run["profile"])
    else:
        rows = _records(tables["profile_ce"], table_columns("profile_ce"))
        for row in rows:
            # the loss function each variant timed (stage-generated text, may carry its error)
            row["source"] = stage_text(row["source"], 160) if row["source"] else None
        wall = {"status": "ok", "rows": rows, "effects": ce_effects(rows)}
    return {"status": "ok", "chunks": chunks, "wall": wall}


def device_rows(kernels: pd.DataFrame, cpu_only: bool) -> pd.DataFrame:
    """Device kernel rows only: the ATen op and the kernel it launched carry the same time."""
    wanted = "CPU" if cpu_only else "CUDA"
    return kernels[kernels["device_type"].astype(str).str.upper() == wanted]


def kernels_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return _not_run(not_run["profile"])
    cpu_only = bool(jsons["profile_provenance"].get("cpu_only"))
    kernels = device_rows(tables["profile_kernels"], cpu_only)
    kernels = kernels.sort_values("device_time_s", ascending=False)
    return {
        "status": "ok",
        "cpu_only": cpu_only,
        "rows": _records(kernels, table_columns("profile_kernels")),
        "total_s": float(kernels["device_time_s"].sum()),
        "share_sum": float(kernels["share"].sum()),
        "dropped_rows": len(tables["profile_kernels"]) - len(kernels),
    }
