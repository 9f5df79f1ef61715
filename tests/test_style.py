"""The repo stays ruff- and snakefmt-clean (the style guide's bar, checked by CI)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "scripts", "tests", "bench", "tools"],
        ["ruff", "format", "--check", "scripts", "tests", "bench", "tools"],
        ["snakefmt", "--check", "Snakefile", "workflow"],
    ],
    ids=["ruff-check", "ruff-format", "snakefmt"],
)
def test_repo_is_lint_clean(command):
    result = subprocess.run(
        [tool(command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
