"""Where the real data for tests and benchmarks lives (FASTDATA_DATA_DIR, default ../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "data_dir"]

DATA_DIR_ENV = "FASTDATA_DATA_DIR"


def data_dir() -> Path:
    """The real-data folder: $FASTDATA_DATA_DIR, else `../shared/data` beside the project root."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"
