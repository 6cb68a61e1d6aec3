"""fastdata: fast input pipelines, memory and communication presets for PyTorch Lightning.

The public API is imported lazily (PEP 562), so `import fastdata` stays cheap and never imports
optional backends such as NVIDIA DALI. `fastdata.tune` is the sizing package (`fastdata.tune.tune`
for a shard folder): a function of that name here would be replaced by the package as soon as any
of its modules is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastdata._pil import require as _require_pil

__version__ = "0.1.0"

# PIL is needed but not a named dependency (Pillow and Pillow-SIMD both provide it: see
# fastdata/_pil.py); without it, say what to install rather than fail deep inside a decode.
_require_pil()

_EXPORTS = {
    "ShardDataModule": "fastdata.datamodule",
    "ShardSet": "fastdata.shardset",
    "CacheSettings": "fastdata.shardset",
    "WorkerSettings": "fastdata.read.base",
    "SegmentationDataModule": "fastdata.datamodules",
    "DetectionDataModule": "fastdata.datamodules",
    "Manifest": "fastdata.manifest",
    "load_manifest": "fastdata.manifest",
    "ShardOptions": "fastdata.write",
    "write_shards": "fastdata.write",
    "open_source": "fastdata.sources",
    "LoaderMonitor": "fastdata.tune.monitor",
    "make_trainer": "fastdata.train",
    "pil_info": "fastdata._pil",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # pragma: no cover
    from fastdata._pil import pil_info  # noqa: F401
    from fastdata.datamodule import ShardDataModule  # noqa: F401
    from fastdata.datamodules import DetectionDataModule, SegmentationDataModule  # noqa: F401
    from fastdata.manifest import Manifest, load_manifest  # noqa: F401
    from fastdata.read.base import WorkerSettings  # noqa: F401
    from fastdata.shardset import CacheSettings, ShardSet  # noqa: F401
    from fastdata.sources import open_source  # noqa: F401
    from fastdata.train import make_trainer  # noqa: F401
    from fastdata.tune.monitor import LoaderMonitor  # noqa: F401
    from fastdata.write import ShardOptions, write_shards  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
