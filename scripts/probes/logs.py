"""Logging for entry scripts: to the rule's log file and to stderr.

Only ids, counts and numbers are ever logged; never example text from the user's data.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(log_path: str | Path | None = None, name: str = "probes") -> logging.Logger:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    return logging.getLogger(name)
