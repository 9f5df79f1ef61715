"""bench/realized_vs_promised.py --trainer sft: what the replay prices beside its table
(``torch_compile`` and its ``pad_to_multiple_of`` companion, the installed ``optim``
alternatives: the estimates' provenance "compile" and "optim", written by
probes.replay.step_changes.priced_beside, the code the stage runs) as rows of the bench's
table, with the settings the bench factory builds each with; and which changes ``--changes``
keeps.

The promise is the replay's record as it stands: compile's saving is a share of the eager run
of the baseline's micro-batches over the trainer's ``num_train_epochs``, its compile time
included; an optim alternative's a share of one optimizer step. The realized epoch is the
Trainer's own ``train_runtime`` with ``torch_compile=True`` (its compile included) or the
other ``optim``; every compiled epoch starts from empty compile caches
(probes.step.compile.fresh_compiles), as the replay's compile pricing does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from probes.step import compile as cp
from probes.step.optim import OPTIM_PREFIX

BESIDE = "priced beside"  # the rows' decision (the replay's table does not hold them)


def is_compile(name: str) -> bool:
    return name == cp.COMPILE_STRATEGY or name.startswith(cp.PAD_MULTIPLE_PREFIX)


def beside_settings(name: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """What the change pastes into the trainer's arguments: ``torch_compile=True`` (with the
    collator's ``pad_to_multiple_of`` for the companion) or the alternative ``optim``."""
    if name == cp.COMPILE_STRATEGY:
        return {"torch_compile": True}
    if name.startswith(cp.PAD_MULTIPLE_PREFIX):
        return {
            "torch_compile": True,
            "pad_to_multiple_of": int(name[len(cp.PAD_MULTIPLE_PREFIX) :]),
        }
    if name.startswith(OPTIM_PREFIX):
        return {"optim": str(record["optim"])}
    raise KeyError(f"{name}: not a change the replay prices beside its table")


def beside_changes(provenance: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, not run): each change the replay priced beside its table, with its promise and
    95% interval, as the document's change rows (settings for the factory); each one it could
    not price (a failed compile, an optimizer it could not build), with why."""
    rows, skipped = [], []
    for group in ("compile", "optim"):
        for name, record in sorted((provenance.get(group) or {}).items()):
            if record.get("saving") is None:
                why = record.get("why") or record.get("memory") or "no saving recorded"
                skipped.append(f"{name}: not priced by the replay ({why})")
                continue
            rows.append(
                {
                    "id": name,
                    "applies": True,
                    "settings": beside_settings(name, record),
                    "measured_saving": float(record["saving"]),
                    "saving_ci_low": float(record["saving_low"]),
                    "saving_ci_high": float(record["saving_high"]),
                    "decision": BESIDE,
                    "record": dict(record),
                }
            )
    return rows, skipped


def wanted(changes: str | None) -> list[str] | None:
    """``--changes a,b``: the ids to realize (None: every change the run prices)."""
    if not changes:
        return None
    return [c.strip() for c in changes.split(",") if c.strip()]


def prices_compile(changes: str | None) -> bool:
    """Whether the replay must price torch_compile (replay.compile): a compile change named."""
    return any(is_compile(name) for name in wanted(changes) or [])


def selected(
    runnable: list[dict[str, Any]], changes: str | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """(kept, not run): the runnable changes ``--changes`` names (all where it is not given),
    and a line for each left out or named but not in this run."""
    names = wanted(changes)
    if names is None:
        return runnable, []
    kept = [c for c in runnable if c["id"] in names]
    skipped = [f"{c['id']}: not in --changes" for c in runnable if c["id"] not in names]
    present = {c["id"] for c in runnable}
    skipped += [f"{n}: named in --changes, not a runnable change of this run" for n in names
                if n not in present]  # fmt: skip
    return kept, skipped


def compile_line(args: Any) -> list[str]:
    """The not-run line for torch_compile where the bench did not price it."""
    if args.trainer != "sft" or prices_compile(args.changes):
        return []
    name = f"{cp.COMPILE_STRATEGY}, {cp.PAD_MULTIPLE_PREFIX}<n>"
    return [f"{name}: not priced (a cold CPU compile is minutes a graph); name it in --changes"]


def compile_seconds(changes: list[dict[str, Any]], runs: Mapping[str, list[dict]]) -> list[str]:
    """For each compiled change realized, the promise in seconds (the replay's record: compile
    time over the plan's shapes, the per-micro-batch saving, the run's micro-batches) beside the
    realized extra seconds (the change's epoch minus the baseline's of the same round, mean with
    its t-interval): the same figures before either is divided by its own epoch."""
    from probes.replay.estimate import t_quantile_975

    base = np.array([r["train_runtime"] for r in runs.get("random", [])])
    lines = []
    for change in changes:
        record, name = change.get("record") or {}, change["id"]
        if not is_compile(name) or name not in runs or "compile_s" not in record:
            continue
        diff = np.array([r["train_runtime"] for r in runs[name]]) - base
        half = (
            t_quantile_975(diff.size - 1) * diff.std(ddof=1) / np.sqrt(diff.size)
            if diff.size > 1
            else float("nan")
        )
        lines.append(
            f"- {name}: promised {-record['saving_s']:.1f} s more [{-record['saving_s_high']:.1f}, "
            f"{-record['saving_s_low']:.1f}] = compile {record['compile_s']:.1f} s "
            f"[{record['compile_s_low']:.1f}, {record['compile_s_high']:.1f}] over "
            f"{record['shapes']} shapes ({record['shapes_measured']} measured, "
            f"{record['recompiles_measured']} recompiles) − {record['micro_batch_saving_s']:.4f} s "
            f"× {record['run_micro_batches']} micro-batches; realized {diff.mean():.1f} s more "
            f"[{diff.mean() - half:.1f}, {diff.mean() + half:.1f}] over {diff.size} rounds "
            f"(the Trainer's epoch minus the baseline's)"
        )
    return lines
