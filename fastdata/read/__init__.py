"""Read side: manifest -> per-rank plan -> decode backend -> uint8 (or augmented) batches.

Backends are looked up by name in `BACKENDS`; optional ones (DALI) are imported only when chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from fastdata.read.base import BatchLoader, LoaderSpec

__all__ = ["BACKENDS", "BatchLoader", "LoaderSpec", "get_backend"]

# name -> "module:function" building a BatchLoader from a LoaderSpec.
BACKENDS: dict[str, str] = {
    "cpu": "fastdata.read.cpu:make_cpu_loader",
    "dali": "fastdata.read.dali:make_dali_loader",
    "memory": "fastdata.read.memory:make_memory_loader",
}


def get_backend(name: str) -> Callable[[LoaderSpec], BatchLoader]:
    """The loader factory of a backend, imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or 'auto', got {name!r}")
    module, func = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), func)
