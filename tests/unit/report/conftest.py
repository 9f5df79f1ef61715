"""The fixture report rendered once per kind of run and shared by the report tests (each render
draws every figure and builds recommendations.json: seconds each)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from stage_fixtures import write_results

from .renders import RUNS, run_report


@pytest.fixture(scope="session")
def report_run(tmp_path_factory) -> Callable[[str], tuple[str, Path]]:
    """report_run(name) -> (markdown, its path), rendered on first use (RUNS names the runs)."""
    cache: dict[str, tuple[str, Path]] = {}

    def get(name: str) -> tuple[str, Path]:
        if name not in cache:
            kwargs, plant = RUNS[name]
            root = tmp_path_factory.mktemp(name.replace(" ", "-"))
            paths = write_results(root / "results", **kwargs)
            if plant:
                plant(paths)
            out = root / "results" / "report" / "playbook-evidence.md"
            run_report(paths, out)
            cache[name] = (out.read_text(), out)
        return cache[name]

    return get
