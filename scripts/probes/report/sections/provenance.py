"""The "Provenance" section: versions, devices, config hash of every stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probes.contracts import STAGES
from probes.report.format import MISSING
from probes.report.sections.shared import device_name, timed_parts


def provenance_section(
    provenance: Mapping[str, Mapping[str, Any]],
    jsons: Mapping[str, Any],
    not_run: Mapping[str, str],
    report_meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Config hash, commit, date and command line per stage, with a warning when they differ."""
    stages = []
    for stage in STAGES:
        meta = provenance.get(stage) or {}
        stages.append(
            {
                "stage": stage,
                "status": "not run" if stage in not_run else "ran",
                "config_hash": meta.get("config_hash", MISSING),
                "git_commit": meta.get("git_commit", MISSING),
                "date": meta.get("date", MISSING),
                "command_line": meta.get("command_line", MISSING),
            }
        )
    hashes = {s["config_hash"] for s in stages if s["config_hash"] != MISSING}
    versions = dict(report_meta.get("versions") or {})
    differing = sorted(
        {
            name
            for meta in provenance.values()
            for name, version in (meta.get("versions") or {}).items()
            if name in versions and version != versions[name]
        }
    )
    profile = jsons["profile_provenance"]
    harness = profile.get("harness")
    slurm = profile.get("slurm")
    return {
        "report": dict(report_meta),
        "versions": versions,
        "stages": stages,
        "config_hashes_agree": len(hashes) <= 1,
        "versions_differ": differing,
        "device": device_name(profile.get("device")) if "profile" not in not_run else MISSING,
        "cpu_only": bool(profile.get("cpu_only")),
        "harness": timed_name(harness),
        "timed_kind": harness.get("kind") if isinstance(harness, Mapping) else None,
        "slurm": (
            {str(k): v for k, v in slurm.items() if v is not None}
            if isinstance(slurm, Mapping)
            else None
        ),
    }


def timed_name(described: Any) -> Any:
    """What the profile timed (shared.timed_parts): "SFTTrainer from its:factory", or the
    harness's spec."""
    parts = timed_parts(described)
    if parts is None:
        return described.get("spec", MISSING) if isinstance(described, Mapping) else described
    if parts["factory"]:
        return f"{parts['name']} from {parts['factory']}"
    return parts["name"]
