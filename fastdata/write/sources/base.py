"""What the shard writer needs from a dataset source.

A source lists its splits and, for any (split, index), returns one `SourceItem`: either pixels
(array sources such as CIFAR), a file path (image folders, list files) or a file's bytes
(Parquet). It does not encode:
choosing how a sample is stored is the writer's job (`fastdata.write.encode`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from fastdata.format.fields import FieldSpec

__all__ = [
    "SPLIT_NAME",
    "BadSourceError",
    "MaskFile",
    "PixelBlock",
    "Source",
    "SourceItem",
    "source_fields",
    "source_skipped",
    "split_name_problem",
]

#: What a split name may be: it becomes part of shard file names (`<split>-000000.tar`) and of
#: sample keys, so a letter or digit, then letters, digits, "_" or "-" (no ".", "/" or spaces).
SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class BadSourceError(ValueError):
    """The source as a whole cannot be read (wrong layout, unsafe archive, bad checksum)."""


@dataclass(frozen=True)
class MaskFile:
    """A mask field's value that the writer reads (in its worker, not when the source opens).

    Args:
        path: the PNG file (8- or 16-bit single channel; a palette PNG is read as its indices).
        num_classes: values must be below this (None: unchecked), except `ignore_index`.
        ignore_index: a value that marks "no class" (e.g. VOC's 255 borders); None: none.
    """

    path: Path
    num_classes: int | None = None
    ignore_index: int | None = None


@dataclass(frozen=True)
class SourceItem:
    """One sample of a source, before encoding.

    Args:
        sample_id: index of the sample within its split in the source's own order (stable).
        label: class index into `Source.classes`; -1 for a sample of a split with fields
            (`Source.sample_fields`), whose classes are in `fields`.
        origin: where the sample comes from, for messages: a file path, or
            "archive.tar.gz:cifar-100-python/train[123]".
        pixels: uint8 HWC RGB array, for array sources; None for file sources.
        path: the image file, for file sources; None for array sources.
        fields: the values of the split's fields besides the image, by field name (see
            `fastdata.format.fields`: a `labels` field holds class indices, a `boxes` field a pair
            (float32 (k, 4) xyxy pixels, int64 (k,) classes), a `mask` field an (H, W) array or
            the `Path` of its PNG, read by the writer). None for a classification sample.
        size: the (height, width) the source expects the image to have (a COCO record's size),
            checked by the writer; None: not known.
        source_id: the sample's id in the source's own terms, recorded at shard time so that
            predictions map back (`fastdata.read.source_ids`): a COCO image id, or a folder's or
            list's image path relative to its root, a Parquet file and row; None: the source has none
            (CIFAR).
        data: the image file's bytes, for sources that hold them (Parquet); read like a file's.
    """

    sample_id: int
    label: int
    origin: str
    pixels: np.ndarray | None = None
    path: Path | None = None
    fields: Mapping[str, Any] | None = None
    size: tuple[int, int] | None = None
    source_id: int | str | None = None
    data: bytes | None = None


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
            way: the writer's statistics read them faster. None: not at hand.
        moments: (6,) uint64, the pixels' per-channel sums then sums of squares, when the
            source counted them while gathering (CIFAR): the writer's statistics take them as
            they are. None: not counted.
    """

    pixels: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    planes: np.ndarray | None = None
    moments: np.ndarray | None = None


@runtime_checkable
class Source(Protocol):
    """A dataset that the shard writer can read by (split, index).

    Implementations must be picklable or fork-safe: the writer's worker processes are forked after
    the source is opened and call `item` concurrently.

    A source whose samples hold more than an image and a label also has
    `sample_fields(split) -> dict[str, FieldSpec] | None`: the fields of `split` besides the
    image (None: a classification split). Read it with `source_fields`.
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


def source_fields(source: Source, split: str) -> dict[str, FieldSpec] | None:
    """The fields of `split` besides its image (`Source.sample_fields`), or None for a
    classification split (and for every source without that method: CIFAR, folders)."""
    method = getattr(source, "sample_fields", None)
    if method is None:
        return None
    found = method(split)
    return None if found is None else dict(found)


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
