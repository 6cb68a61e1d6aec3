"""What the shard writer needs from a dataset source.

A source lists its splits and, for any (split, index), returns one `SourceItem`: either pixels
(array sources such as CIFAR) or a file path (image folders, list files). It does not encode:
choosing how a sample is stored is the writer's job (`fastdata.write.encode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["BadSourceError", "Source", "SourceItem"]


class BadSourceError(ValueError):
    """The source as a whole cannot be read (wrong layout, unsafe archive, bad checksum)."""


@dataclass(frozen=True)
class SourceItem:
    """One sample of a source, before encoding.

    Args:
        sample_id: index of the sample within its split in the source's own order (stable).
        label: class index into `Source.classes`.
        origin: where the sample comes from, for messages: a file path, or
            "archive.tar.gz:cifar-100-python/train[123]".
        pixels: uint8 HWC RGB array, for array sources; None for file sources.
        path: the image file, for file sources; None for array sources.
    """

    sample_id: int
    label: int
    origin: str
    pixels: np.ndarray | None = None
    path: Path | None = None


@runtime_checkable
class Source(Protocol):
    """A dataset that the shard writer can read by (split, index).

    Implementations must be picklable or fork-safe: the writer's worker processes are forked after
    the source is opened and call `item` concurrently.
    """

    kind: str  # "cifar10", "cifar100", "folder", "list"
    classes: list[str]

    def splits(self) -> dict[str, int]:
        """Split name -> number of samples, e.g. {"train": 50000, "test": 10000}."""
        ...

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th sample of `split` (0 <= index < splits()[split])."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """JSON-serializable identity of the input (kind, resolved path, sizes, mtimes or hashes),
        used to tell "the same dataset" (resume) from "a different dataset" (refuse to overwrite)."""
        ...


def describe_path(path: Path) -> str:
    """A path as shown in messages: absolute, so the user can find it."""
    return str(path.resolve())
