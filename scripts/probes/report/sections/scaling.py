"""The "Scaling" section: the profile's scaling points, the fit t(T) = aT² + bT + c and the
padding penalty."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import table_columns
from probes.report.findings import fit_problem
from probes.report.format import finite
from probes.report.sections.shared import device_name, not_run_section, records


def scaling_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    if "profile" in not_run:
        return not_run_section(not_run["profile"])
    provenance = jsons["profile_provenance"]
    scaling = tables["profile_scaling"].sort_values("seq_len")
    fit = tables["profile_fit"]
    ok = scaling["status"] == "OK"
    return {
        "status": "ok",
        "cpu_only": bool(provenance.get("cpu_only")),
        "device": device_name(provenance.get("device")),
        # probes.step.dtype: the dtype the profile ran in and why (provenance.json)
        "dtype": provenance.get("dtype"),
        "dtype_reason": provenance.get("dtype_reason"),
        # probes.profile.flops.MFU_CONVENTION: how the `mfu` column counts model FLOPs
        "mfu_convention": provenance.get("mfu_convention"),
        # probes.profile.flops.mfu_unverified_reason: the FLOP counter did not confirm the count
        "mfu_unverified_reason": provenance.get("mfu_unverified_reason"),
        "points": records(scaling, table_columns("profile_scaling")),
        "n_ok": int(ok.sum()),
        "n_failed": int((~ok).sum()),
        "fit": records(fit, table_columns("profile_fit"))[0] if not fit.empty else None,
        "fit_usable": fit_problem(tables, not_run) is None,
        "fit_problem": fit_problem(tables, not_run),
        "max_fitted_len": finite(scaling.loc[ok, "seq_len"].max()),
        "penalty": records(
            tables["profile_padding_penalty"], table_columns("profile_padding_penalty")
        ),
        "penalty_skipped": skipped_reason(tables["profile_padding_penalty"]),
    }


def skipped_reason(penalty: pd.DataFrame) -> str | None:
    """Why no penalty batch was timed (the skipped rows' `pick`), or None where any was."""
    # the statuses of probes.step.timing (not imported: it imports torch), as "OK" above
    if penalty.empty or not (penalty["status"] == "SKIPPED").all():
        return None
    return str(penalty["pick"].iloc[0]) if "pick" in penalty.columns else "not recorded"
