"""Reading the padding stage's lengths table: the one reader every downstream stage uses.

`lengths.parquet` has one row per example and every status; only OK and TRUNCATED rows train.
EMPTY and ERROR rows are counted, never folded into a distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from probes.contracts import STATUSES, TABLES, TRAINING_STATUSES, UNKNOWN_SOURCE
from probes.errors import ProbeError

# The columns downstream stages need (the padding stage writes all of contracts.LENGTH_COLUMNS);
# `file` and `row` are read when present, to point at an offending example.
READ_COLUMNS = tuple(c for c in TABLES["padding_lengths"].required if c != "reason")
LOCATION_COLUMNS = ("file", "row")


class LengthsError(ProbeError, ValueError):
    """lengths.parquet violates the padding stage's contract; the message names file, row, key."""


@dataclass(frozen=True)
class LengthSet:
    """Token lengths of the usable examples, their sources as codes, and what was left out."""

    lengths: np.ndarray  # int64, tokens kept per example (≤ max_seq_len)
    sources: np.ndarray  # int32 codes into source_names
    source_names: tuple[str, ...]
    status_counts: dict[str, int] = field(default_factory=dict)

    @property
    def n_sources(self) -> int:
        return len(self.source_names)

    @property
    def sources_known(self) -> bool:
        return any(name != UNKNOWN_SOURCE for name in self.source_names)


def encode_sources(names: Sequence[str] | np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Integer codes for source names, in sorted-name order so codes are deterministic."""
    uniques, codes = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int32), tuple(str(u) for u in uniques)


def lengths_from_frame(frame: pd.DataFrame, max_seq_len: int, origin: str = "lengths") -> LengthSet:
    """Check the padding stage's table and keep rows with status OK or TRUNCATED.

    EMPTY and ERROR rows are counted, never folded into the distribution.
    """
    missing = [c for c in READ_COLUMNS if c not in frame.columns]
    if missing:
        raise LengthsError(
            f"{origin}: missing column(s) {missing}; expected the padding stage's lengths table "
            f"with columns {list(READ_COLUMNS)}. Rerun the `padding` rule."
        )
    status = frame["status"].astype(str)
    bad_status = ~status.isin(STATUSES)
    if bad_status.any():
        where = _row_ref(frame, int(np.flatnonzero(bad_status.to_numpy())[0]))
        raise LengthsError(
            f"{origin}: {where}: column 'status' has {sorted(set(status[bad_status]))}; "
            f"allowed are {list(STATUSES)}."
        )
    counts = {s: int((status == s).sum()) for s in STATUSES}
    used = frame.loc[status.isin(TRAINING_STATUSES).to_numpy()]
    if used.empty:
        raise LengthsError(
            f"{origin}: no row has status OK or TRUNCATED (counts {counts}); nothing to batch. "
            "Check the data files and the padding stage's log."
        )
    n_tokens = pd.to_numeric(used["n_tokens"], errors="coerce")
    bad = n_tokens.isna() | (n_tokens < 1) | (n_tokens > max_seq_len) | (n_tokens % 1 != 0)
    if bad.any():
        pos = int(np.flatnonzero(bad.to_numpy())[0])
        value = used["n_tokens"].iloc[pos]
        raise LengthsError(
            f"{origin}: {_row_ref(used, pos)}: n_tokens={value} for a {used['status'].iloc[pos]} "
            f"example; it must be an integer in [1, training.max_seq_len={max_seq_len}]. Rerun "
            "`padding` with the same training.max_seq_len (a changed config reruns it)."
        )
    sources = used["source"].fillna(UNKNOWN_SOURCE).astype(str).to_numpy()
    codes, names = encode_sources(sources)
    return LengthSet(
        lengths=n_tokens.to_numpy(dtype=np.int64),
        sources=codes,
        source_names=names,
        status_counts=counts,
    )


def read_lengths(path: str | Path, max_seq_len: int) -> LengthSet:
    """Read results/padding/lengths.parquet (or any file with its schema)."""
    return lengths_from_frame(read_lengths_frame(path), max_seq_len, origin=str(path))


def _row_ref(frame: pd.DataFrame, pos: int) -> str:
    row = frame.iloc[pos]
    where = ", ".join(f"{c}={row[c]}" for c in LOCATION_COLUMNS if c in frame.columns)
    return f"example_id={row['example_id']}" + (f" ({where})" if where else "")


def read_lengths_frame(path: str | Path) -> pd.DataFrame:
    """The lengths table as written (every status), with its columns checked."""
    path = Path(path)
    if not path.is_file():
        raise LengthsError(
            f"{path}: no such file; it is written by the `padding` rule "
            "(run `snakemake bucket_sweep`, which runs it first)."
        )
    try:
        present = set(pq.read_schema(path).names)
        missing = [c for c in READ_COLUMNS if c not in present]
        if missing:
            raise KeyError(f"missing column(s) {missing}")
        wanted = list(READ_COLUMNS) + [c for c in LOCATION_COLUMNS if c in present]
        return pd.read_parquet(path, columns=wanted)
    except (ValueError, KeyError, OSError) as error:  # missing column or not Parquet
        raise LengthsError(
            f"{path}: cannot read the lengths table ({type(error).__name__}: {error}); expected "
            f"Parquet with columns {list(READ_COLUMNS)}. Rerun the `padding` rule."
        ) from error


def read_training_lengths(path: str | Path, max_seq_len: int) -> pd.DataFrame:
    """The rows that train (OK, TRUNCATED), checked as `read_lengths` checks them, in data order."""
    frame = read_lengths_frame(path)
    lengths_from_frame(frame, max_seq_len, origin=str(path))  # the same checks, same messages
    train = frame.loc[frame["status"].isin(TRAINING_STATUSES)].copy()
    train["n_tokens"] = train["n_tokens"].astype("int64")
    train["n_loss_tokens"] = (
        train["n_loss_tokens"].astype("int64").clip(lower=0).clip(upper=train["n_tokens"])
    )
    return train.reset_index(drop=True)
