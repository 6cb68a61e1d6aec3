"""Dataset sources: turn a dataset on disk into `SourceItem`s for the shard writer.

src = open_source("cifar100", "cifar-100-python.tar.gz")
src = open_source("folder", "clothing-small/")
src = open_source("list", "labels.csv", root="images/")
src = open_source("coco", "val2017/", "instances_val2017.json")
src = open_source("segmentation", "JPEGImages/", "SegmentationClass/")
src = open_source("parquet", "data/")  # a Hugging Face image dataset's Parquet files
src = open_source("video", "clips/")  # class folders of videos, or a list file

`REGISTRY` is the one list of sources: `fastdata shard`'s choices, its help and the number of
inputs each takes are read from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fastdata.write.sources.base import BadSourceError, MaskFile, Source, SourceItem
from fastdata.write.sources.cifar import CifarSource
from fastdata.write.sources.coco import CocoSource
from fastdata.write.sources.download import DownloadError
from fastdata.write.sources.folder import FolderSource
from fastdata.write.sources.listfile import ListSource
from fastdata.write.sources.parquet import ParquetSource
from fastdata.write.sources.safe_pickle import UnsafePickleError
from fastdata.write.sources.safe_tar import UnsafeArchiveError
from fastdata.write.sources.segmentation import SegmentationSource
from fastdata.write.sources.video import VideoSource

__all__ = [
    "REGISTRY",
    "SOURCES",
    "BadSourceError",
    "CifarSource",
    "CocoSource",
    "DownloadError",
    "FolderSource",
    "ListSource",
    "MaskFile",
    "ParquetSource",
    "SegmentationSource",
    "Source",
    "SourceItem",
    "SourceKind",
    "UnsafeArchiveError",
    "UnsafePickleError",
    "VideoSource",
    "open_source",
]


@dataclass(frozen=True)
class SourceKind:
    """One kind of source in the registry.

    Args:
        name: what `fastdata shard NAME` and `open_source(NAME, ...)` call it.
        factory: builds the source from its inputs and keyword options.
        help: one line for `fastdata shard --help`.
        inputs: the names of its positional inputs, before OUT (e.g. ("IMAGES", "ANNOTATIONS")).
        options: the factory's keyword options that `fastdata shard` sets from the flag of the
            same name (`max_json_bytes` from `--max-json-bytes`); the flag is refused for the
            other sources.
    """

    name: str
    factory: Callable[..., Source]
    help: str
    inputs: tuple[str, ...] = ("INPUT",)
    options: tuple[str, ...] = ()


REGISTRY: dict[str, SourceKind] = {
    k.name: k
    for k in (
        SourceKind(
            "cifar10",
            partial(CifarSource, kind="cifar10"),
            "CIFAR-10 python archive or folder (or --download)",
            options=("download",),
        ),
        SourceKind(
            "cifar100",
            partial(CifarSource, kind="cifar100"),
            "CIFAR-100 python archive or folder (or --download)",
            options=("download",),
        ),
        SourceKind("folder", FolderSource, "class-per-folder images, optional train/val/test"),
        SourceKind(
            "list",
            ListSource,
            "CSV/JSONL list: path, label | labels (multi-label) | caption/text, other columns",
            options=("classes", "max_classes"),
        ),
        SourceKind(
            "coco",
            CocoSource,
            "COCO detection: image folder + instances json (boxes; crowd kept apart)",
            ("IMAGES", "ANNOTATIONS"),
            ("split", "max_json_bytes"),
        ),
        SourceKind(
            "segmentation",
            SegmentationSource,
            "image folder + PNG class-index mask folder, paired by stem",
            ("IMAGES", "MASKS"),
            ("classes", "ignore_index"),
        ),
        SourceKind(
            "parquet",
            ParquetSource,
            "Parquet file(s): Hugging Face image datasets (image struct, label, class names) or "
            "plain columns (image bytes or path, label, other columns as fields)",
            options=("classes", "split"),
        ),
        SourceKind(
            "video",
            VideoSource,
            "videos (MP4, WebM, MOV, MKV) kept as they are, with a clip index: class-per-folder "
            "tree or CSV/JSONL list (path,label[,split])",
            options=("classes", "max_classes", "max_video_bytes"),
        ),
    )
}

# Source kind -> factory taking (input, **kwargs) (the registry's factories).
SOURCES: dict[str, Callable[..., Source]] = {name: k.factory for name, k in REGISTRY.items()}


def open_source(kind: str, input: str | Path | None, *more: str | Path, **kwargs: Any) -> Source:
    """Open a dataset of the given kind.

    Args:
        kind: one of `REGISTRY` ("cifar10", "cifar100", "folder", "list", "coco",
            "segmentation", "parquet").
        input: the archive, folder, list file or Parquet file (None only for CIFAR with `download=True`); the
            image folder for "coco" and "segmentation".
        *more: further inputs: the annotations json ("coco"), the mask folder ("segmentation").
        **kwargs: passed to the source class (e.g. `download=True`, `label="coarse"`,
            `splits=["train", "val"]`, `root=...`, `classes=[...]`).

    Raises:
        ValueError: an unknown kind, or the wrong number of inputs.
        BadSourceError: the input cannot be read as that kind of dataset.
    """
    entry = REGISTRY.get(kind)
    if entry is None:
        raise ValueError(f"unknown source kind {kind!r}; expected one of {', '.join(REGISTRY)}")
    if len(more) != len(entry.inputs) - 1:
        raise ValueError(
            f"source {kind!r} takes {len(entry.inputs)} input(s) ({', '.join(entry.inputs)}), "
            f"got {1 + len(more)}"
        )
    return entry.factory(input, *more, **kwargs)
