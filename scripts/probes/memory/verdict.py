"""Fits / does not fit / unknown against the target GPU, and the largest micro-batch that fits.

A verdict is three-way: `fits` (predicted peak at or under the target), `does not fit` (over it:
never recommended as it is; the reason says what would make it fit), `unknown` (the step could not
be predicted: the reason says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30
FITS, DOES_NOT_FIT, UNKNOWN = "fits", "does not fit", "unknown"
VERDICTS = (FITS, DOES_NOT_FIT, UNKNOWN)


def verdict(peak_bytes: int | None, target_bytes: int) -> str:
    if peak_bytes is None:
        return UNKNOWN
    return FITS if peak_bytes <= target_bytes else DOES_NOT_FIT


def headroom_gib(peak_bytes: int | None, target_bytes: int) -> float | None:
    return None if peak_bytes is None else (target_bytes - peak_bytes) / GIB


def advice(
    by_category: dict[str, int],
    target_bytes: int,
    gradient_checkpointing: bool,
    fitting_rows: int | None,
) -> str:
    """What would make a shape that does not fit fit (the largest part first)."""
    parts = []
    fixed = by_category.get("parameters", 0) + by_category.get("optimizer_state", 0)
    if fixed > target_bytes:
        parts.append(
            f"the parameters and optimizer state alone ({fixed / GIB:.1f} GiB) exceed the "
            "target: shard them (FSDP/ZeRO) or quantise the base weights"
        )
    if not gradient_checkpointing:
        parts.append("turn on gradient checkpointing (profile.harness_options)")
    if fitting_rows:
        parts.append(f"as configured, at most {fitting_rows} rows per micro-batch at this length")
    elif fitting_rows == 0:
        parts.append("as configured, not even one row fits at this length")
    parts.append("a chunked loss if the harness holds full logits")
    return "; ".join(parts)


@dataclass(frozen=True)
class FittingRows:
    rows: int  # the largest micro-batch that fits and divides the tokens per update (0: none)
    grad_accum: int | None  # keeps micro_batch_size x grad_accum (None when rows is 0)
    peak_bytes: int | None  # predicted at `rows`
    method: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_fitting_rows(
    peak_at: Callable[[int], int], target_bytes: int, rows_per_update: int
) -> FittingRows:
    """The largest divisor of `rows_per_update` whose predicted peak fits.

    The peak is affine in the rows at a fixed length (every activation is per row; the rest is
    not): two predictions (1 and 2 rows) give the line, and the candidate it picks is predicted
    itself; a candidate over the target steps down to the next divisor, each one predicted.
    """
    one = peak_at(1)
    if one > target_bytes:
        return FittingRows(0, None, one, "1 row predicted over the target")
    if rows_per_update == 1:
        return FittingRows(1, 1, one, "predicted at 1 row")
    two = peak_at(2)
    slope = max(two - one, 1)
    line_rows = int((target_bytes - (one - slope)) // slope)
    options = [d for d in divisors(rows_per_update) if d <= max(line_rows, 1)]
    known = {1: one, 2: two}
    for rows in reversed(options):
        peak = known[rows] if rows in known else peak_at(rows)
        known[rows] = peak
        if peak <= target_bytes:
            method = (
                f"affine in rows from 1 and 2 rows ({slope / GIB:.3f} GiB per row), "
                f"confirmed by a prediction at {rows} rows"
            )
            return FittingRows(rows, rows_per_update // rows, peak, method)
    return FittingRows(1, rows_per_update, one, "predicted at 1 row")
