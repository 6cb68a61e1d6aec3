"""What the shard writer needs from a dataset source.

A source lists its splits and, for any (split, index), returns one `SourceItem`: either pixels
(array sources such as CIFAR) or a file path (image folders, list files). It does not encode:
choosing how a sample is stored is the writer's job (`fastdata.write.encode`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "SPLIT_NAME",
    "BadSourceError",
    "PixelBlock",
    "Source",
    "SourceItem",
    "source_skipped",
    "split_name_problem",
]

#: What a split name may be: it becomes part of shard file names (`<split>-000000.tar`) and of
#: sample keys, so a letter or digit, then letters, digits, "_" or "-" (no ".", "/" or spaces).
SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


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


@dataclass(frozen=True)
class PixelBlock:
    """Many samples of an array source at once: what `item` gives for each, stacked.

    An array source may offer ``pixel_block(split, indices) -> PixelBlock``: the writer then
    lays out a raw-encoded shard in one go (`fastdata.write.rawblock`) instead of calling `item`
    per sample. Row i must equal ``item(split, indices[i])``.

    Args:
        pixels: (N, H, W, 3) uint8, C-contiguous: row i is item i's `pixels`.
        labels: (N,) int64: item i's `label`.
        sample_ids: (N,) int64: item i's `sample_id`.
        planes: the same pixels channel-first, (N, 3, H * W), when the source holds them that
            way (CIFAR): the writer's statistics read them faster. None: not at hand.
    """

    pixels: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    planes: np.ndarray | None = None


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


def source_skipped(source: Source) -> dict[str, list[tuple[str, str]]]:
    """Split -> [(origin, reason)] of the entries a source found unusable while opening (a folder
    source's unreadable folders and broken symlinks); {} for a source that keeps no such list.

    The writer adds them to the run's skipped samples: in the manifest, the report and the
    `max_bad` count.
    """
    found = getattr(source, "skipped", None)
    if not isinstance(found, dict):
        return {}
    return {str(split): [(str(o), str(r)) for o, r in items] for split, items in found.items()}


def describe_path(path: Path) -> str:
    """A path as shown in messages: absolute, so the user can find it."""
    return str(path.resolve())


def split_name_problem(name: object) -> str | None:
    """Why `name` cannot be a split name (see `SPLIT_NAME`), or None when it can."""
    if isinstance(name, str) and SPLIT_NAME.fullmatch(name):
        return None
    return (
        f"split name {name!r:.60} is not allowed: a split name is 1-64 letters, digits, '_' or '-', "
        "starting with a letter or digit (it becomes part of the shard file names)"
    )
