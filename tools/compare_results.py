"""Compare two results/ directories table by table: what a refactor must leave unchanged.

    python tools/compare_results.py OLD_RESULTS NEW_RESULTS

Parquet tables are compared as data (provenance metadata ignored). Durations (`*_s`,
`seconds`, `time`, by whole name parts) differ run to run and are left out of every table; for
profile tables, whose measured columns are broader (`mfu`, shares, memory, fitted coefficients),
only the shape, the columns and the untimed text/integer columns (as sets of rows) are
compared. The replay's and realize's outputs and recommendations.json come from sequential
designs that follow the timings (which micro-batches get timed, which change ranks first), so
only their columns / keys are compared ("measured"). JSON files are compared with their
run-specific keys (provenance, wall time, dates) removed.
Prints one line per file and exits 1 on a difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

RUN_SPECIFIC_KEYS = {
    "provenance",
    "wall_seconds",
    "build_seconds",
    "trace_seconds",
    "config_hash",
    "run",
    "date",
    "versions",
}
TIMED_MARKERS = (
    "time",
    "_s",
    "seconds",
    "mfu",
    "share",
    "mem",
    "penalty",
    "tokens_per_s",
    "residual",
    "top_",
)


def timed(column: str) -> bool:
    """A profile table's measured column (broad: anything a timing or a fit made)."""
    return any(marker in column for marker in TIMED_MARKERS)


def timing(column: str) -> bool:
    """A duration in any table, by whole name parts (`wall_s`, `seconds`, `time_s`), so that
    `n_steps` or `micro_batch_size` are never taken for one."""
    parts = str(column).split("_")
    return parts[-1] == "s" or "seconds" in parts or "time" in parts


def strip(obj, root: Path | None = None):
    """`obj` without run-specific keys, each path inside `root` (the results directory it was
    read from) written relative to it, so two directories at different paths compare equal."""
    if isinstance(obj, dict):
        return {k: strip(v, root) for k, v in obj.items() if k not in RUN_SPECIFIC_KEYS}
    if isinstance(obj, list):
        return [strip(v, root) for v in obj]
    if isinstance(obj, str) and root is not None:
        return relative_to_root(obj, root)
    return obj


def relative_to_root(text: str, root: Path) -> str:
    for prefix in {root.as_posix(), root.resolve().as_posix()}:
        if text == prefix or text.startswith(prefix.rstrip("/") + "/"):
            return "<results>" + text[len(prefix.rstrip("/")) :]
    return text


def follows_timings(path: Path) -> bool:
    """Outputs of a design that adapts to what it timed (replay, realize, the recommendations)."""
    return (
        "realize" in path.parts
        or path.name.startswith("replay")
        or path.name == "recommendations.json"
    )


def compare_table(old: Path, new: Path) -> str | None:
    a, b = pd.read_parquet(old), pd.read_parquet(new)
    if list(a.columns) != list(b.columns):
        return f"columns differ: {sorted(set(a.columns) ^ set(b.columns))}"
    if follows_timings(old):
        return None
    a = a[[c for c in a.columns if not timing(c)]]
    b = b[[c for c in b.columns if not timing(c)]]
    if a.shape != b.shape:
        return f"shape {a.shape} -> {b.shape}"
    if "profile" in old.parts:  # measured: compare the untimed text/integer columns as sets
        untimed = [c for c in a.columns if not timed(c) and a[c].dtype.kind in "OUbi"]
        a = a[untimed].astype(str).sort_values(untimed).reset_index(drop=True)
        b = b[untimed].astype(str).sort_values(untimed).reset_index(drop=True)
    try:
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    except AssertionError as error:
        if same_rows(a, b):
            return "same rows in another order"
        return str(error).splitlines()[0]
    return None


def same_rows(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    key = [str(c) for c in a.columns]
    rows_a = a.astype(str).sort_values(key).reset_index(drop=True)
    rows_b = b.astype(str).sort_values(key).reset_index(drop=True)
    return rows_a.equals(rows_b)


def main(old_dir: str, new_dir: str) -> int:
    old_root, new_root = Path(old_dir), Path(new_dir)
    failures = 0
    for old in sorted(old_root.rglob("*")):
        if old.is_dir() or old.suffix not in (".parquet", ".json"):
            continue
        new = new_root / old.relative_to(old_root)
        if not new.exists():
            problem = "missing in the new results"
        elif old.suffix == ".parquet":
            problem = compare_table(old, new)
        elif "profile" in old.parts or follows_timings(old):
            problem = (
                None
                if set(json.loads(old.read_text())) <= set(json.loads(new.read_text()))
                else "keys missing"
            )
        else:
            same = strip(json.loads(old.read_text()), old_root) == strip(
                json.loads(new.read_text()), new_root
            )
            problem = None if same else "content differs"
        failures += problem is not None
        kind = "measured" if follows_timings(old) and not problem else "same"
        print(f"{'DIFF' if problem else kind}  {old.relative_to(old_root)}  {problem or ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
