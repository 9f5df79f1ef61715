"""Outputs: Parquet with provenance in the file metadata, JSON, atomic writes, run metadata."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

PROVENANCE_KEY = b"probes.provenance"
VERSIONED_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "snakemake",
    "pandas",
    "pyarrow",
    "jinja2",
)


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of the config (key order does not matter)."""
    canonical = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def git_commit(repo: Path | None = None) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=repo or Path.cwd(),
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_metadata(config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Provenance stamped into every output: config hash, versions, commit, date, command line."""
    return {
        "config_hash": config_hash(config or {}),
        # per section, so a standalone stage can tell whether the sections an upstream output
        # depends on changed (probes.stage.check_upstream_config)
        "config_section_hashes": {
            section: config_hash({section: value}) for section, value in (config or {}).items()
        },
        "versions": package_versions(),
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command_line": " ".join(sys.argv),
        "host_platform": platform.platform(),
    }


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds.

    A failed stage therefore never leaves a partial output behind.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600; outputs should be as readable as any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_parquet(frame: pd.DataFrame, path: str | Path, provenance: dict[str, Any]) -> None:
    """Write a table with the run's provenance (config hash, versions...) in its file metadata."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    existing = table.schema.metadata or {}
    table = table.replace_schema_metadata(
        {**existing, PROVENANCE_KEY: json.dumps(provenance, sort_keys=True, default=str).encode()}
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_parquet(path: str | Path) -> pd.DataFrame:
    return pd.read_parquet(path)


def read_provenance(path: str | Path) -> dict[str, Any]:
    raw = (pq.read_schema(path).metadata or {}).get(PROVENANCE_KEY)
    return json.loads(raw) if raw else {}


def write_json(obj: Any, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def write_text(text: str, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays, Paths
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
