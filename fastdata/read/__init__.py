"""Read side: manifest -> epoch plan -> decode backend -> uint8 (or normalized) batches.

Backends are registered in `BACKENDS` with their metadata; `auto`, the tuner, the CLI and the
pipelines read it. A new backend is one module plus one line here. Optional backends (DALI,
torchvision's nvJPEG) are imported only when chosen or probed. `BatchLoader`, `LoaderSpec` and
`WorkerSettings` (from `fastdata.read.base`, which imports torch) load on first use, so that the
torch-free modules of this package (`plan`, `shardio`) can be imported without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fastdata.read.base import BatchLoader, LoaderSpec, WorkerSettings

_FROM_BASE = ("BatchLoader", "LoaderSpec", "WorkerSettings")

__all__ = [
    "AUTO",
    "BACKENDS",
    "Backend",
    "BatchLoader",
    "LoaderSpec",
    "WorkerSettings",
    "backend_choices",
    "field_backends",
    "get_backend",
]

#: The backend name that lets `fastdata.read.backends.auto` choose one of `BACKENDS`.
AUTO = "auto"


@dataclass(frozen=True)
class Backend:
    """A read backend and what `auto`, the tuner and the CLI need to know about it.

    Args:
        name: the name users pass as `backend=`.
        factory: ``"module:function"`` building a `BatchLoader` from a `LoaderSpec`.
        available: ``"module:function"`` returning (usable here?, reason when not); must not
            raise, and must not initialize CUDA.
        uses_workers: its loading runs in DataLoader worker processes (the tuner sizes them).
        resident: it keeps the decoded split resident on the device (auto checks memory).
        decodes_on_gpu: it decodes on the GPU (when the memory store won't fit, auto takes the
            fastest of these by measurement: `fastdata.read.backends.auto.probe_rate`).
        user_transforms: it hands uint8 batches over, so user callables can run on them.
        carries_fields: it reads every field of a split (`fastdata.format.fields`: masks, boxes,
            text, ...), not only the classification pair (image, label); `auto` picks only
            such a backend for a split with other fields.
    """

    name: str
    factory: str
    available: str
    uses_workers: bool
    resident: bool = False
    decodes_on_gpu: bool = False
    user_transforms: bool = True
    carries_fields: bool = False

    def load(self) -> Callable[[LoaderSpec], BatchLoader]:
        """The loader factory, imported on first use."""
        module, func = self.factory.split(":")
        return getattr(importlib.import_module(module), func)

    def check(self) -> tuple[bool, str]:
        """(usable here, reason when not)."""
        module, func = self.available.split(":")
        try:
            return getattr(importlib.import_module(module), func)()
        except Exception as exc:  # noqa: BLE001 - a broken optional install is "unavailable"
            return False, f"{type(exc).__name__}: {exc}"


def _always() -> tuple[bool, str]:
    return True, ""


_BUILTIN = "fastdata.read:_always"

#: name -> Backend. `auto` checks "memory" first; GPU decoders are then ranked by a probe of
#: their rate (this order breaks a tie), and "cpu" is the fallback.
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "memory",
            "fastdata.read.backends.memory:make_memory_loader",
            _BUILTIN,
            uses_workers=False,
            resident=True,
            carries_fields=True,
        ),
        Backend(
            "dali",
            "fastdata.read.backends.dali:make_dali_loader",
            "fastdata.read.backends.dali:dali_status",
            uses_workers=False,
            decodes_on_gpu=True,
        ),
        Backend(
            "nvjpeg",
            "fastdata.read.backends.nvjpeg:make_nvjpeg_loader",
            "fastdata.read.backends.nvjpeg:nvjpeg_status",
            uses_workers=False,
            decodes_on_gpu=True,
        ),
        Backend(
            "cpu",
            "fastdata.read.backends.cpu:make_cpu_loader",
            _BUILTIN,
            uses_workers=True,
            carries_fields=True,
        ),
    )
}


def get_backend(name: str) -> Backend:
    """The registered backend `name`.

    Raises:
        ValueError: no backend of that name (the message lists the registered ones).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or {AUTO!r}, got {name!r}")
    return BACKENDS[name]


def backend_choices(auto: bool = True) -> list[str]:
    """The names a user may pass as a backend (CLI choices): "auto" first, then `BACKENDS`'
    names in registration order. Read at call time, so a backend registered later appears."""
    return ([AUTO] if auto else []) + list(BACKENDS)


def field_backends() -> list[str]:
    """The registered backends that carry every field of a split (`Backend.carries_fields`):
    the ones an error about a non-classification split should name."""
    return [b.name for b in BACKENDS.values() if b.carries_fields]


def __getattr__(name: str) -> Any:
    """`BatchLoader`, `LoaderSpec`, `WorkerSettings`: imported from `fastdata.read.base` on use."""
    if name in _FROM_BASE:
        from fastdata.read import base

        value = getattr(base, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastdata.read' has no attribute {name!r}")
