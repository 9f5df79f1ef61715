"""The Bucketing section's measured data-parallel part: real DDP steps under torchrun against the
prediction from one-process timings (``probes.dp``), the communication share and straggler wait,
and where each rank ran. Not run at world_size 1 (the rule is not in the DAG)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import STRATEGY_ORDER


def data_parallel_measured_section(
    tables: Mapping[str, pd.DataFrame], not_run: Mapping[str, str], jsons: Mapping[str, Any]
) -> dict[str, Any]:
    """{"status": "ok", world_size, backend, device_type, cpu_only, tolerance, rows, ranks} or
    {"status": "not_run", "reason"}."""
    if "data_parallel" in not_run:
        reason = not_run["data_parallel"]
        if reason == "world_size 1":
            reason = (
                "world_size 1: the data_parallel rule runs only with training.world_size > 1 "
                "(the straggler costs above are from the data's lengths)"
            )
        return {"status": "not_run", "reason": reason}
    summary = jsons["data_parallel_summary"]
    rows = []
    order = {name: i for i, name in enumerate(STRATEGY_ORDER)}
    for strategy, values in sorted(
        summary["strategies"].items(), key=lambda kv: order.get(kv[0], len(order))
    ):
        n = max(int(values["steps_measured"]), 1)
        rows.append(
            {
                "strategy": strategy,
                "real_s": values["real_s"] / n,
                "predicted_s": values["predicted_s"] / n,
                "ratio": values["ratio"],
                "within": values["within_tolerance"],
                "compute_s": values["compute_s_per_step"],
                "wait_s": values["wait_s_per_step"],
                "collective_s": values["collective_s_per_step"],
                "communication_share": values["communication_share"],
                "straggler_wait_share": values["straggler_wait_share"],
                "real_saving": values.get("real_saving_vs_random_per_step"),
                "predicted_saving": values.get("predicted_saving_vs_random_per_step"),
                "steps_measured": n,
            }
        )
    ranks = [
        {
            "rank": r["rank"],
            "local_rank": r["local_rank"],
            "hostname": r["hostname"],
            "device": r["device"],
            "slurm_job": (r.get("slurm") or {}).get("job_id"),
        }
        for r in sorted(summary["ranks"], key=lambda r: r["rank"])
    ]
    return {
        "status": "ok",
        "world_size": summary["world_size"],
        "backend": summary["backend"],
        "device_type": summary.get("device_type"),
        "cpu_only": summary.get("cpu_only"),
        "max_seq_len": summary.get("max_seq_len_measured"),
        "tolerance": summary["tolerance"],
        "rows": rows,
        "ranks": ranks,
    }
