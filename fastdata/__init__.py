"""fastdata: fast input pipelines, memory and communication presets for PyTorch Lightning.

The public API is imported lazily (PEP 562), so `import fastdata` stays cheap and never imports
optional backends such as NVIDIA DALI. `fastdata.tune` is the sizing package (`fastdata.tune.tune`
for a shard folder): a function of that name here would be replaced by the package as soon as any
of its modules is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastdata._util.pil import require as _require_pil
from fastdata._util.version import __version__

# PIL is needed but not a named dependency (Pillow and Pillow-SIMD both provide it: see
# fastdata/_util/pil.py); without it, say what to install rather than fail deep inside a decode.
_require_pil()

_EXPORTS = {
    "ShardDataModule": "fastdata.lightning.datamodule",
    "ShardSet": "fastdata.lightning.options",
    "ShardSource": "fastdata.lightning.prepare",
    "Schedule": "fastdata.read.schedule",
    "CacheSettings": "fastdata.lightning.options",
    "WorkerSettings": "fastdata.read.base",
    "SegmentationDataModule": "fastdata.lightning.family",
    "DetectionDataModule": "fastdata.lightning.family",
    "Manifest": "fastdata.format.manifest",
    "load_manifest": "fastdata.format.manifest_io",
    "ShardOptions": "fastdata.write",
    "write_shards": "fastdata.write",
    "open_source": "fastdata.write.sources",
    "LoaderMonitor": "fastdata.tune.monitor",
    "make_trainer": "fastdata.train",
    "Preset": "fastdata.augment",
    "verify": "fastdata.read.verify",
    "index_shards": "fastdata.write.index",
    # Kept here (not only in `_util`): the one call that says which PIL runs when Pillow and
    # Pillow-SIMD clash, documented as `fastdata.pil_info()` (README, docs/PIL.md).
    "pil_info": "fastdata._util.pil",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # pragma: no cover
    from fastdata._util.pil import pil_info  # noqa: F401
    from fastdata.augment import Preset  # noqa: F401
    from fastdata.format.manifest import Manifest  # noqa: F401
    from fastdata.format.manifest_io import load_manifest  # noqa: F401
    from fastdata.lightning.datamodule import ShardDataModule  # noqa: F401
    from fastdata.lightning.family import DetectionDataModule, SegmentationDataModule  # noqa: F401
    from fastdata.lightning.options import CacheSettings, ShardSet  # noqa: F401
    from fastdata.lightning.prepare import ShardSource  # noqa: F401
    from fastdata.read.base import WorkerSettings  # noqa: F401
    from fastdata.read.schedule import Schedule  # noqa: F401
    from fastdata.read.verify import verify  # noqa: F401
    from fastdata.train import make_trainer  # noqa: F401
    from fastdata.tune.monitor import LoaderMonitor  # noqa: F401
    from fastdata.write import ShardOptions, write_shards  # noqa: F401
    from fastdata.write.index import index_shards  # noqa: F401
    from fastdata.write.sources import open_source  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
