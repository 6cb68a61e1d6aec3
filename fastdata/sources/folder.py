"""Image folders in the class-per-folder layout (torchvision's ImageFolder), with or without splits.

    root/<class>/**/<image>                       one split, named "train"
    root/{train,val,validation,test}/<class>/**/<image>

Items are file paths; the writer reads (and usually keeps) the encoded bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastdata.sources.base import BadSourceError, SourceItem, describe_path

__all__ = ["IMAGE_EXTENSIONS", "SPLIT_NAMES", "FolderSource"]

log = logging.getLogger(__name__)

# Compared lower-cased: "IMG_0001.JPG" and "scan.Tiff" are images. Every format here is decoded at
# shard time by Pillow or, where this Pillow-SIMD lacks the codec, imagecodecs (fastdata.write.images).
IMAGE_EXTENSIONS = frozenset(
    {
        *(".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".bmp", ".dib", ".gif", ".webp"),
        *(".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".jp2", ".j2k", ".jpx", ".avif"),
    }
)
# Folder names that mark the split layout (kept as found: "validation" stays "validation").
SPLIT_NAMES = ("train", "val", "validation", "test")
_FLAT_SPLIT = "train"

_LAYOUT_HELP = (
    "Expected root/<class>/<image> (one split) or root/{train,val,validation,test}/<class>/<image>, "
    f"with images ending in {', '.join(sorted(IMAGE_EXTENSIONS))}."
)


class FolderSource:
    """A folder of class folders of images.

    Classes are the sorted union of the class folder names of all splits, so a label index means
    the same class in every split. Images are found recursively under each class folder and
    sorted by path; hidden files and folders are skipped; other files are ignored and counted in
    `ignored_files`.

    Args:
        root: the dataset folder.
        splits: "auto" (split folders if `root` has any of `SPLIT_NAMES` holding class folders,
            else a single "train" split), "none" (`root` holds the class folders: one "train"
            split), or the names of the split folders to use.

    Raises:
        ValueError: a bad `splits` value.
        BadSourceError: `root` is not a folder, or a split has no class folders or no images.
    """

    kind = "folder"

    def __init__(self, root: str | Path, splits: str | Sequence[str] = "auto") -> None:
        if root is None:
            raise ValueError("FolderSource needs the dataset folder as input, got None")
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise BadSourceError(f"{describe_path(self.root)}: not a folder. {_LAYOUT_HELP}")
        split_dirs = _split_dirs(self.root, splits)
        class_dirs = {split: _class_dirs(folder) for split, folder in split_dirs.items()}
        self.classes: list[str] = sorted({c for names in class_dirs.values() for c in names})
        self.ignored_files = 0
        self._files: dict[str, list[str]] = {}
        self._labels: dict[str, np.ndarray] = {}
        for split, folder in split_dirs.items():
            files, labels, ignored = _scan_split(self.root, folder, class_dirs[split], self.classes)
            self._files[split], self._labels[split] = files, labels
            self.ignored_files += ignored
        if self.ignored_files:
            log.info("%s: ignored %d files that are not images", self.root, self.ignored_files)
        self._fingerprint: dict[str, Any] | None = None

    def splits(self) -> dict[str, int]:
        """Split name (as found on disk) -> number of images."""
        return {split: len(files) for split, files in self._files.items()}

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th image of `split` in path order."""
        if split not in self._files:
            raise ValueError(f"unknown split {split!r}; {self.root} has {sorted(self._files)}")
        files = self._files[split]
        if not 0 <= index < len(files):
            raise IndexError(f"{split}[{index}] is out of range: the split has {len(files)} images")
        path = self.root / files[index]
        return SourceItem(
            sample_id=index, label=int(self._labels[split][index]), origin=str(path), path=path
        )

    def fingerprint(self) -> dict[str, Any]:
        """Kind, resolved root, per-split counts, number of files, total bytes, newest mtime."""
        if self._fingerprint is None:
            sizes, mtime = 0, 0
            for files in self._files.values():
                for rel in files:
                    stat = (self.root / rel).stat()
                    sizes += stat.st_size
                    mtime = max(mtime, stat.st_mtime_ns)
            self._fingerprint = {
                "kind": self.kind,
                "root": str(self.root),
                "splits": self.splits(),
                "files": sum(self.splits().values()),
                "bytes": sizes,
                "max_mtime_ns": mtime,
            }
        return dict(self._fingerprint)


def _visible_dirs(folder: Path) -> list[Path]:
    """Sub-folders of `folder` that are not hidden, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _split_dirs(root: Path, splits: str | Sequence[str]) -> dict[str, Path]:
    """Split name -> split folder, following `splits` (see `FolderSource`)."""
    if splits == "none":
        return {_FLAT_SPLIT: root}
    if isinstance(splits, str) and splits != "auto":
        raise ValueError(f"splits must be 'auto', 'none' or a list of folder names, got {splits!r}")
    if splits != "auto":
        missing = [s for s in splits if not (root / s).is_dir()]
        if missing or not splits:
            raise BadSourceError(
                f"{describe_path(root)}: no split folder(s) {missing or splits}; "
                f"it has {[p.name for p in _visible_dirs(root)]}."
            )
        return {s: root / s for s in splits}
    children = _visible_dirs(root)
    # "train" holding images directly is a class named "train", not a split.
    found = [c for c in children if c.name in SPLIT_NAMES and _visible_dirs(c)]
    if not found:
        return {_FLAT_SPLIT: root}
    others = [c.name for c in children if c not in found]
    if others:
        raise BadSourceError(
            f"{describe_path(root)}: mixes split folders {[c.name for c in found]} with other "
            f"folders {others}; pass splits=[...] to choose the split folders, or splits='none' "
            "if they are all classes."
        )
    return {c.name: c for c in found}


def _class_dirs(split_dir: Path) -> list[str]:
    """Class folder names of a split folder (raises if there are none)."""
    names = [p.name for p in _visible_dirs(split_dir)]
    if not names:
        raise BadSourceError(f"{describe_path(split_dir)}: no class folders. {_LAYOUT_HELP}")
    return names


def _scan_split(
    root: Path, split_dir: Path, class_names: list[str], classes: list[str]
) -> tuple[list[str], np.ndarray, int]:
    """(image paths relative to root, labels, number of ignored files) of one split folder."""
    index = {name: i for i, name in enumerate(classes)}
    files: list[str] = []
    labels: list[int] = []
    ignored = sum(1 for p in split_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    for name in class_names:
        images, skipped = _images_under(split_dir / name)
        files += [os.path.relpath(p, root) for p in images]
        labels += [index[name]] * len(images)
        ignored += skipped
    if not files:
        raise BadSourceError(
            f"{describe_path(split_dir)}: no images in its class folders "
            f"({ignored} other files ignored). {_LAYOUT_HELP}"
        )
    return files, np.asarray(labels, dtype=np.int64), ignored


def _images_under(folder: Path) -> tuple[list[str], int]:
    """(sorted image files under `folder`, recursively, skipping hidden ones; other files)."""
    images: list[str] = []
    ignored = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                images.append(os.path.join(dirpath, name))
            else:
                ignored += 1
    return sorted(images), ignored
