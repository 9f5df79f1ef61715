"""The Bucketing section's measured data-parallel part: real DDP / FSDP2 steps under torchrun
against the prediction from one-process timings (``probes.dp``), per sharding and strategy, the
communication share and straggler wait, what was timed and where each rank ran. Not run at
world_size 1 (the rule is not in the DAG)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from probes.contracts import STRATEGY_ORDER
from probes.report.sections.shared import stage_text

SHARDING_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2"}


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
    rows = [
        measured_row(sharding, strategy, values)
        for sharding, strategies in summary["runs"].items()
        for strategy, values in ordered(strategies)
    ]
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
        "timed": timed_words(summary.get("timed_step") or {}),
        "not_measured": [
            f"{SHARDING_NAMES.get(k, k)}: {stage_text(v, 160)}"
            for k, v in (summary.get("not_measured") or {}).items()
        ],
    }


def ordered(strategies: Mapping[str, Any]) -> list[tuple[str, Any]]:
    order = {name: i for i, name in enumerate(STRATEGY_ORDER)}
    return sorted(strategies.items(), key=lambda kv: order.get(kv[0], len(order)))


def measured_row(sharding: str, strategy: str, values: Mapping[str, Any]) -> dict[str, Any]:
    n = max(int(values["steps_measured"]), 1)
    return {
        "sharding": SHARDING_NAMES.get(sharding, sharding),
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


def timed_words(timed: Mapping[str, Any]) -> str:
    """What the ranks ran: the user's trainer (its class, how it was given) or the harness."""
    if timed.get("kind") == "trainer":
        given = "trainer.command" if "command" in timed else "trainer.factory"
        return (
            f"the user's {stage_text(timed.get('trainer', 'Trainer'), 60)} ({given}), its own "
            "distributed dataloader's micro-batches and its accelerator's wrap"
        )
    return "the profile.harness's loss in DDP, each rank its shard of the plans"
