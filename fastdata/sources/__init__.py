"""Dataset sources: turn a dataset on disk into `SourceItem`s for the shard writer.

src = open_source("cifar100", "cifar-100-python.tar.gz")
src = open_source("folder", "clothing-small/")
src = open_source("list", "labels.csv", root="images/")
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from fastdata.sources.base import BadSourceError, Source, SourceItem
from fastdata.sources.cifar import CifarSource
from fastdata.sources.download import DownloadError
from fastdata.sources.folder import FolderSource
from fastdata.sources.listfile import ListSource
from fastdata.sources.safe_pickle import UnsafePickleError
from fastdata.sources.safe_tar import UnsafeArchiveError

__all__ = [
    "SOURCES",
    "BadSourceError",
    "CifarSource",
    "DownloadError",
    "FolderSource",
    "ListSource",
    "Source",
    "SourceItem",
    "UnsafeArchiveError",
    "UnsafePickleError",
    "open_source",
]

# Source kind -> factory taking (input, **kwargs).
SOURCES: dict[str, Callable[..., Source]] = {
    "cifar10": partial(CifarSource, kind="cifar10"),
    "cifar100": partial(CifarSource, kind="cifar100"),
    "folder": FolderSource,
    "list": ListSource,
}


def open_source(kind: str, input: str | Path | None, **kwargs: Any) -> Source:
    """Open a dataset of the given kind.

    Args:
        kind: one of `SOURCES` ("cifar10", "cifar100", "folder", "list").
        input: the archive, folder or list file (None only for CIFAR with `download=True`).
        **kwargs: passed to the source class (e.g. `download=True`, `label="coarse"`,
            `splits=["train", "val"]`, `root=...`).

    Raises:
        ValueError: an unknown kind.
        BadSourceError: the input cannot be read as that kind of dataset.
    """
    factory = SOURCES.get(kind)
    if factory is None:
        raise ValueError(f"unknown source kind {kind!r}; expected one of {', '.join(SOURCES)}")
    return factory(input, **kwargs)
