"""bench/realized_vs_promised.py --trainer sft: what the replay prices beside its table
(``torch_compile`` and its ``pad_to_multiple_of`` companion, the installed ``optim``
alternatives: the estimates' provenance "compile" and "optim", written by
probes.replay.step_changes.priced_beside, the code the stage runs) as rows of the bench's
table, with the settings the bench factory builds each with; and which changes ``--changes``
keeps.

The promise is the replay's record as it stands: compile's saving is a share of the replay's
baseline epoch estimate over the trainer's ``num_train_epochs``, its compile time included; an
optim alternative's a share of one optimizer step. The realized epoch is the Trainer's own
``train_runtime`` with ``torch_compile=True`` (its compile included) or the other ``optim``;
every compiled epoch starts from empty compile caches (probes.step.compile.fresh_compiles), as
the replay's compile pricing does, but in the bench's process after the replay's compiles: it
does not pay a fresh process's first-compile excess, so compile's promise here is the record's
``saving_warm_process`` (its ``saving`` less that excess, which a user's run pays).
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
            key = "saving_warm_process" if "saving_warm_process" in record else "saving"
            rows.append(
                {
                    "id": name,
                    "applies": True,
                    "settings": beside_settings(name, record),
                    "measured_saving": float(record[key]),
                    "saving_ci_low": float(record[f"{key}_low"]),
                    "saving_ci_high": float(record[f"{key}_high"]),
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
    """For each compiled change realized, the promise in seconds in a process that has compiled
    before, as the bench's realized epochs run (the replay's record: compile time over the
    plan's shapes, the per-micro-batch saving, the run's micro-batches; a fresh process's
    first-compile excess apart) beside the realized extra seconds (the change's epoch minus the
    baseline's of the same round, mean with its t-interval): the same figures before either is
    divided by its own epoch."""
    base = np.array([r["train_runtime"] for r in runs.get("random", [])])
    lines = []
    for change in changes:
        record, name = change.get("record") or {}, change["id"]
        if not is_compile(name) or name not in runs or "compile_s" not in record:
            continue
        diff = np.array([r["train_runtime"] for r in runs[name]]) - base
        lines.append(f"- {name}: {promised_seconds(record)}; {realized_seconds(diff)}")
    return lines


def promised_seconds(record: Mapping[str, Any]) -> str:
    """The record's extra seconds in a process that has compiled before, and what they are."""
    first = [record.get(f"first_compile_s{end}", 0.0) for end in ("", "_low", "_high")]
    spread = record.get("compile_spread", float("nan"))
    warm = (record["saving_s"] + first[0], record["saving_s_low"] + first[2],
            record["saving_s_high"] + first[1])  # fmt: skip
    return (
        f"promised {-warm[0]:.1f} s more [{-warm[2]:.1f}, {-warm[1]:.1f}] in a process that "
        f"has compiled = compile {record['compile_s'] - first[0]:.1f} s "
        f"[{record['compile_s_low'] - first[1]:.1f}, {record['compile_s_high'] - first[2]:.1f}] "
        f"over {record['shapes']} shapes ({record['shapes_measured']} measured: "
        f"{record.get('shapes_compiled_measured', '?')} compiled, "
        f"{record['recompiles_measured']} recompiles, {record.get('graphs_measured', '?')} "
        f"graphs) − {record['micro_batch_saving_s']:.4f} s × {record['run_micro_batches']} "
        f"micro-batches (a fresh process: + first compile {first[0]:.1f} s "
        f"[{first[1]:.1f}, {first[2]:.1f}]; spread {spread:.0%})"
    )


def realized_seconds(diff: np.ndarray) -> str:
    """The realized extra seconds: mean of the paired differences with its t-interval."""
    from probes.replay.greg import t_quantile_975

    half = (
        t_quantile_975(diff.size - 1) * diff.std(ddof=1) / np.sqrt(diff.size)
        if diff.size > 1
        else float("nan")
    )
    return (
        f"realized {diff.mean():.1f} s more [{diff.mean() - half:.1f}, {diff.mean() + half:.1f}] "
        f"over {diff.size} rounds (the Trainer's epoch minus the baseline's)"
    )
