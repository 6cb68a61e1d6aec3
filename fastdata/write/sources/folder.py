"""Image folders in the class-per-folder layout (torchvision's ImageFolder), with or without splits.

    root/<class>/**/<image>                       one split, named "train"
    root/{train,val,validation,test}/<class>/**/<image>

Items are file paths; the writer reads (and usually keeps) the encoded bytes.

The tree is untrusted: nothing found in it aborts the scan or vanishes. A class folder or
sub-folder that cannot be listed, a dangling or looping symlink, a symlinked class folder that
points back into its own split or to an ancestor of it (its images would count twice, or
forever), and a symlinked folder below a class folder (not followed) are listed in `skipped`
with a reason, like a bad image, and end up in the manifest's skipped list. Only an unreadable
dataset or split folder is an error.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any, NamedTuple

import numpy as np

from fastdata.write.sources.base import (
    BadSourceError,
    SourceItem,
    describe_path,
    split_name_problem,
)

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


def _kind(extensions: frozenset[str]) -> str:
    """What the files are called in messages: images, or (another extension set) files."""
    return "image" if extensions == IMAGE_EXTENSIONS else "file"


def _layout_help(extensions: frozenset[str] = IMAGE_EXTENSIONS) -> str:
    """The expected tree, for errors, naming the file kinds the source takes."""
    kind = _kind(extensions)
    return (
        f"Expected root/<class>/<{kind}> (one split) or "
        f"root/{{train,val,validation,test}}/<class>/<{kind}>, "
        f"with {kind}s ending in {', '.join(sorted(extensions))}."
    )


class FolderSource:
    """A folder of class folders of images.

    Classes are the sorted union of the class folder names of all splits, so a label index means
    the same class in every split. Images are found recursively under each class folder and
    sorted by path; hidden files and folders are skipped; other files are ignored and counted in
    `ignored_files`; entries that cannot be used (see the module docstring) are listed per split
    in `skipped` as (path, reason).

    Args:
        root: the dataset folder.
        splits: "auto" (split folders if `root` has any of `SPLIT_NAMES` holding class folders,
            else a single "train" split), "none" (`root` holds the class folders: one "train"
            split), or the names of the split folders to use.
        extensions: the file extensions (lower case, with the dot) of the files to take;
            default `IMAGE_EXTENSIONS` (the video source passes its own).

    Raises:
        ValueError: a bad `splits` value.
        BadSourceError: `root` or a split folder is not a readable folder, or a split has no
            class folders or no images.
    """

    kind = "folder"

    def __init__(
        self,
        root: str | Path,
        splits: str | Sequence[str] = "auto",
        extensions: frozenset[str] = IMAGE_EXTENSIONS,
    ) -> None:
        if root is None:
            raise ValueError("FolderSource needs the dataset folder as input, got None")
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise BadSourceError(
                f"{describe_path(self.root)}: not a folder. {_layout_help(extensions)}"
            )
        split_dirs = _split_dirs(self.root, splits)
        self.skipped: dict[str, list[tuple[str, str]]] = {split: [] for split in split_dirs}
        class_dirs = {
            split: _class_dirs(folder, self.skipped[split], extensions)
            for split, folder in split_dirs.items()
        }
        self.classes: list[str] = sorted({c for names in class_dirs.values() for c in names})
        self.ignored_files = 0
        self._files: dict[str, list[str]] = {}
        self._labels: dict[str, np.ndarray] = {}
        self._sizes = 0
        self._mtime = 0
        for split, folder in split_dirs.items():
            scan = _scan_split(self.root, folder, class_dirs[split], self.classes, extensions)
            self._files[split], self._labels[split] = scan.files, scan.labels
            self.skipped[split] += scan.skipped
            self.ignored_files += scan.ignored
            self._sizes += scan.bytes
            self._mtime = max(self._mtime, scan.max_mtime_ns)
        self.skipped = {split: found for split, found in self.skipped.items() if found}
        if self.ignored_files:
            log.info("%s: ignored %d files that are not images", self.root, self.ignored_files)
        for split, found in self.skipped.items():
            log.warning("%s: %d unusable entries in split %r", self.root, len(found), split)

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
            sample_id=index,
            label=int(self._labels[split][index]),
            origin=str(path),
            path=path,
            source_id=PurePath(files[index]).as_posix(),  # relative to root, "/" on every OS
        )

    def fingerprint(self) -> dict[str, Any]:
        """Kind, resolved root, per-split counts, number of files, total bytes, newest mtime
        (sizes and times as found by the scan, which stats every image once)."""
        return {
            "kind": self.kind,
            "root": str(self.root),
            "splits": self.splits(),
            "files": sum(self.splits().values()),
            "bytes": self._sizes,
            "max_mtime_ns": self._mtime,
        }


class _Entry(NamedTuple):
    """One visible directory entry: its path, name and what it is (after following a symlink)."""

    path: str
    name: str
    is_dir: bool
    is_file: bool
    is_link: bool
    st: os.stat_result | None  # None: a symlink that cannot be followed (see `error`)
    error: str


def _entries(folder: Path | str) -> list[_Entry]:
    """The non-hidden entries of `folder`, sorted by name (OSError if it cannot be listed)."""
    found = []
    with os.scandir(folder) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            is_link = e.is_symlink()
            try:
                st = os.stat(e.path)  # follows a symlink
                error = ""
            except OSError as exc:
                st, error = None, _broken_link(exc)
            mode = st.st_mode if st is not None else 0
            found.append(
                _Entry(e.path, e.name, stat.S_ISDIR(mode), stat.S_ISREG(mode), is_link, st, error)
            )
    return sorted(found, key=lambda entry: entry.name)


def _broken_link(exc: OSError) -> str:
    return f"broken symlink ({exc.strerror or exc}): its target cannot be reached"


def _listed(folder: Path, what: str) -> list[_Entry]:
    """`_entries` of a dataset or split folder, whose failure is the whole source's."""
    try:
        return _entries(folder)
    except OSError as exc:
        raise BadSourceError(
            f"{describe_path(folder)}: cannot list the {what} ({exc.strerror or exc}); "
            "check its permissions"
        ) from exc


def _visible_dirs(folder: Path) -> list[Path]:
    """Sub-folders of `folder` that are not hidden, sorted by name."""
    return [Path(e.path) for e in _listed(folder, "folder") if e.is_dir]


def _split_dirs(root: Path, splits: str | Sequence[str]) -> dict[str, Path]:
    """Split name -> split folder, following `splits` (see `FolderSource`)."""
    if splits == "none":
        return {_FLAT_SPLIT: root}
    if isinstance(splits, str) and splits != "auto":
        raise ValueError(f"splits must be 'auto', 'none' or a list of folder names, got {splits!r}")
    if splits != "auto":
        for name in splits:
            if (problem := split_name_problem(name)) is not None:
                raise ValueError(f"FolderSource(splits=...): {problem}")
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


def _class_dirs(
    split_dir: Path,
    skipped: list[tuple[str, str]],
    extensions: frozenset[str] = IMAGE_EXTENSIONS,
) -> list[str]:
    """Class folder names of a split folder (raises if there are none); a broken symlink or a
    symlink into the split itself or to an ancestor is added to `skipped` instead."""
    names = []
    here = split_dir.resolve()
    for entry in _listed(split_dir, "split folder"):
        if entry.is_link and entry.st is None:
            skipped.append((entry.path, entry.error))
        elif entry.is_dir and entry.is_link:
            target = Path(os.path.realpath(entry.path))
            if target == here or here.is_relative_to(target) or target.is_relative_to(here):
                where = (
                    "the split folder or an ancestor of it (a cycle)"
                    if here.is_relative_to(target)
                    else "a folder inside its own split folder"
                )
                skipped.append(
                    (
                        entry.path,
                        f"class folder is a symlink to {target}, {where}: its images would be "
                        "counted twice under another class; not used",
                    )
                )
            else:
                names.append(entry.name)
        elif entry.is_dir:
            names.append(entry.name)
    if not names:
        raise BadSourceError(
            f"{describe_path(split_dir)}: no class folders. {_layout_help(extensions)}"
        )
    return names


class _SplitScan(NamedTuple):
    files: list[str]  # image paths relative to the root
    labels: np.ndarray
    ignored: int  # files that are not images
    skipped: list[tuple[str, str]]  # (path, reason)
    bytes: int
    max_mtime_ns: int


def _scan_split(
    root: Path,
    split_dir: Path,
    class_names: list[str],
    classes: list[str],
    extensions: frozenset[str] = IMAGE_EXTENSIONS,
) -> _SplitScan:
    """The images (relative to root), labels and unusable entries of one split folder."""
    index = {name: i for i, name in enumerate(classes)}
    files: list[str] = []
    labels: list[int] = []
    skipped: list[tuple[str, str]] = []
    sizes = mtime = 0
    ignored = sum(1 for e in _listed(split_dir, "split folder") if e.is_file)
    for name in class_names:
        images, skipped_files = _images_under(split_dir / name, skipped, extensions)
        files += [os.path.relpath(path, root) for path, _ in images]
        labels += [index[name]] * len(images)
        ignored += skipped_files
        sizes += sum(st.st_size for _, st in images)
        mtime = max([mtime, *(st.st_mtime_ns for _, st in images)])
    if not files:
        reasons = f"; unusable: {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise BadSourceError(
            f"{describe_path(split_dir)}: no {_kind(extensions)}s in its class folders "
            f"({ignored} other files ignored{reasons}). {_layout_help(extensions)}"
        )
    return _SplitScan(files, np.asarray(labels, dtype=np.int64), ignored, skipped, sizes, mtime)


def _images_under(
    folder: Path, skipped: list[tuple[str, str]], extensions: frozenset[str] = IMAGE_EXTENSIONS
) -> tuple[list[tuple[str, os.stat_result]], int]:
    """(sorted (image file, stat) under `folder`, recursively, skipping hidden ones; number of
    other files). Folders that cannot be listed and broken or folder symlinks go to `skipped`."""
    images: list[tuple[str, os.stat_result]] = []
    ignored = 0
    pending = [str(folder)]
    while pending:
        current = pending.pop()
        try:
            entries = _entries(current)
        except OSError as exc:
            skipped.append((current, f"cannot list folder ({exc.strerror or exc})"))
            continue
        for entry in entries:
            if entry.st is None:
                skipped.append((entry.path, entry.error))
            elif entry.is_dir and entry.is_link:
                skipped.append((entry.path, "symlinked folder inside a class folder: not followed"))
            elif entry.is_dir:
                pending.append(entry.path)
            elif entry.is_file and os.path.splitext(entry.name)[1].lower() in extensions:
                images.append((entry.path, entry.st))
            else:
                ignored += 1
    return sorted(images, key=lambda image: image[0]), ignored
