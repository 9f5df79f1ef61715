"""The memory stage's sharded table: each rank's predicted peak under FSDP2 at every configured
world size (`memory.world_sizes`, `memory.reshard_after_forward`) for the training shape, and the
smallest world size that fits the target, added to the training row of the shapes table.

The prediction is `probes.memory.fsdp.predict_sharded` (fake tensors, a fake process group,
torch's FSDPMemTracker); a world size that cannot be predicted is `unknown` with its reason.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd

from probes.contracts.tables import table_columns
from probes.memory.fsdp import (
    ShardedPrediction,
    Sharding,
    predict_sharded,
    predict_sharded_scaled,
)
from probes.memory.predict import PredictError, Shape, StepFunctions
from probes.memory.shapes import TRAINING
from probes.memory.verdict import FITS, GIB, headroom_gib, verdict

LOG = logging.getLogger("probes.memory")
STRATEGY = "fsdp2"
TABLE = "memory_sharded"
# FSDPMemTracker's reference types, summed into the columns the table shows
KINDS = {
    "parameters_gib": ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER"),
    "gradients_gib": ("SHARDED_GRAD", "UNSHARDED_GRAD"),
    "optimizer_state_gib": ("OPT",),
    "activations_gib": ("ACT", "TEMP", "INP"),
    "communication_gib": ("ALL_GATHER", "REDUCE_SCATTER"),
}
SMALLEST = "smallest_world_size"
FITS_ON = "fits_on_gpus"


def shardings(world_sizes: Any, reshard_options: Any) -> list[Sharding]:
    return [Sharding(int(w), bool(r)) for w in world_sizes for r in reshard_options]


def sharded_row(found: ShardedPrediction | PredictError, sharding: Sharding, shape: Shape,
                target: int) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {
        "shape": shape.name,
        "strategy": STRATEGY,
        "world_size": sharding.world_size,
        "reshard_after_forward": sharding.reshard_after_forward,
        "rows": shape.rows,
        "length": shape.length,
        "target_gib": target / GIB,
    }
    if isinstance(found, PredictError):
        return {**row, "predicted_peak_gib": None, "headroom_gib": None,
                "verdict": verdict(None, target), "reason": str(found)}  # fmt: skip
    row.update({k: sum(found.by_kind.get(kind, 0) for kind in kinds) / GIB
                for k, kinds in KINDS.items()})  # fmt: skip
    row.update(
        predicted_peak_gib=found.peak_bytes / GIB,
        headroom_gib=headroom_gib(found.peak_bytes, target),
        verdict=verdict(found.peak_bytes, target),
        reason="",
        seconds=found.seconds,
        assumptions="; ".join(found.notes),
    )
    return row


def sharded_frame(
    config: Any,
    functions: StepFunctions,
    dtype: str,
    shape: Shape,
    memory: Any,
    attn_implementation: str,
    grad_accum: int = 1,
) -> pd.DataFrame:
    """One row per (world size, reshard_after_forward): rank 0's predicted peak at `shape`; in
    increasing world size up to the first that fits unless memory.every_world_size."""
    target = int(memory.target_gib * GIB)
    predict_fn = predict_sharded_scaled if memory.scale_layers else predict_sharded
    rows: list[dict[str, Any]] = []
    for sharding in shardings(sorted(memory.world_sizes), memory.reshard_after_forward):
        if not memory.every_world_size and any(
            r["verdict"] == FITS and r["world_size"] < sharding.world_size for r in rows
        ):
            break  # a smaller world size fits: the smallest is the answer
        try:
            found: ShardedPrediction | PredictError = predict_fn(
                config, functions, dtype, shape, sharding, attn_implementation, grad_accum
            )
        except PredictError as error:
            found = error
        except (RuntimeError, AttributeError, NotImplementedError, ValueError) as error:
            # FSDP2 or its tracker refusing this model is this world size's answer (unknown,
            # with the words), not the stage's failure: the one-GPU figures stand
            first = (str(error).strip().splitlines() or [""])[0][:200]
            found = PredictError(
                f"FSDP2 at W={sharding.world_size} could not be predicted "
                f"({type(error).__name__}: {first})"
            )
        row = sharded_row(found, sharding, shape, target)
        LOG.info(
            "%s W=%d reshard=%s: %s GiB per rank, %s", shape.name, sharding.world_size,
            sharding.reshard_after_forward, row["predicted_peak_gib"], row["verdict"],
        )  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows) if rows else empty_sharded()


def needs_sharding(shapes: pd.DataFrame, memory: Any) -> bool:
    """Whether to predict under FSDP2: every world size asked for, or the training shape does
    not fit one GPU (then the smallest world size that fits is what the user needs)."""
    if not memory.world_sizes:
        return False
    training = shapes[shapes["shape"] == TRAINING] if "shape" in shapes else shapes.iloc[:0]
    return bool(memory.every_world_size) or training.empty or (training["verdict"] != FITS).any()


def empty_sharded() -> pd.DataFrame:
    return pd.DataFrame(columns=list(table_columns(TABLE)))


def smallest_fitting(sharded: pd.DataFrame) -> int | None:
    """The fewest ranks at which some predicted FSDP2 setting fits the target."""
    if sharded.empty:
        return None
    fitting = sharded[sharded["verdict"] == FITS]
    return None if fitting.empty else int(fitting["world_size"].min())


def fits_on_words(sharded: pd.DataFrame, target_name: str) -> str:
    """ "fits on 2 GPUs (FSDP2)"; or that none of the predicted world sizes fits."""
    smallest = smallest_fitting(sharded)
    if smallest is not None:
        plural = "GPU" if smallest == 1 else "GPUs"
        return f"fits on {smallest} {target_name} {plural} (FSDP2)"
    known = sharded[sharded["predicted_peak_gib"].notna()] if not sharded.empty else sharded
    if known.empty:
        return "not predicted under FSDP2"
    most = int(known["world_size"].max())
    return f"does not fit on {most} {target_name} GPUs (FSDP2); more ranks or a smaller step"


def with_world_sizes(
    shapes: pd.DataFrame, sharded: pd.DataFrame, training: str, target_name: str
) -> pd.DataFrame:
    """The training row gains the smallest world size that fits and its words."""
    if sharded.empty:
        return shapes
    shapes = shapes.copy()
    index = shapes.index[shapes["shape"] == training]
    shapes[SMALLEST] = pd.Series([None] * len(shapes), index=shapes.index, dtype="Int64")
    shapes[FITS_ON] = pd.Series([None] * len(shapes), index=shapes.index, dtype="object")
    shapes.loc[index, SMALLEST] = smallest_fitting(sharded)
    shapes.loc[index, FITS_ON] = fits_on_words(sharded, target_name)
    return shapes
