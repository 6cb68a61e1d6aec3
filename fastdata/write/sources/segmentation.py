"""Semantic segmentation: a folder of images and a folder of PNG masks, paired by stem.

    fastdata shard segmentation IMAGES MASKS OUT [--classes classes.txt]

    IMAGES/<any/sub/path>/<name>.<jpg|png|...>     MASKS/<any/sub/path>/<name>.png
    IMAGES/{train,val,...}/...                      MASKS/{train,val,...}/...   (several splits)

An image and a mask pair when their paths relative to IMAGES and MASKS are the same without the
extension (`2007_000032.jpg` <-> `2007_000032.png`). A mask is an 8- or 16-bit single-channel PNG
of class indices (a palette PNG, as VOC's, is read as its indices), with its image's size (the
writer checks it; the error names both files). `ignore_index` (default 255, VOC's border) marks
pixels of no class. Classes are the lines of `--classes` (names), else "0".."max" over every mask
(every mask is read once when the source opens: pass `classes` to avoid that on a large dataset).
An image without a mask, a mask without an image and an unreadable mask are listed as skipped
(in the manifest, and counted towards `--max-bad`); under `--strict` the first of them stops the
run, named, before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

from fastdata.format.fields import FieldSpec
from fastdata.write.sources.base import (
    BadSourceError,
    MaskFile,
    SourceItem,
    describe_path,
    split_name_problem,
)
from fastdata.write.sources.folder import SPLIT_NAMES, _images_under, _visible_dirs

__all__ = ["SegmentationSource"]

_FIELDS = {"mask": FieldSpec("mask", "mask", ("mask.png",))}
_FLAT_SPLIT = "train"


class SegmentationSource:
    """Images and their class-index masks (one split, or split folders as `FolderSource`).

    Args:
        images: the image folder.
        masks: the mask folder (same layout, `.png` files).
        classes: class names (index i = mask value i), or None: "0".."max" found in the masks.
        ignore_index: the mask value of pixels without a class (not a class); None: none.

    Raises:
        BadSourceError: a folder is missing, the two folders' splits differ, a split has no pair,
            or a mask value is not below `len(classes)` (names the mask) when scanning.
    """

    kind = "segmentation"

    def __init__(
        self,
        images: str | Path,
        masks: str | Path,
        classes: Sequence[str] | None = None,
        ignore_index: int | None = 255,
    ) -> None:
        if images is None or masks is None:
            raise ValueError("SegmentationSource needs the image folder and the mask folder")
        self.images = Path(images).expanduser().resolve()
        self.masks = Path(masks).expanduser().resolve()
        for folder in (self.images, self.masks):
            if not folder.is_dir():
                raise BadSourceError(f"{describe_path(folder)}: not a folder")
        self.ignore_index = ignore_index
        split_dirs = _splits(self.images, self.masks)
        self.skipped: dict[str, list[tuple[str, str]]] = {}
        self._pairs: dict[str, list[tuple[str, str]]] = {}
        for split, (image_dir, mask_dir) in split_dirs.items():
            pairs, lost = _pair(image_dir, mask_dir)
            if lost:
                self.skipped[split] = lost
            if not pairs:
                raise BadSourceError(
                    f"{image_dir} and {mask_dir}: no image has a mask of the same stem "
                    f"({len(lost)} unpaired files, e.g. {lost[0][0] if lost else '-'})"
                )
            self._pairs[split] = [
                (os.path.relpath(i, self.images), os.path.relpath(m, self.masks)) for i, m in pairs
            ]
        if classes is not None:
            self.classes = [str(c) for c in classes]
            if not self.classes:
                raise ValueError("classes must name at least one class")
        else:
            self.classes = [str(i) for i in range(self._scan_max() + 1)]

    def _scan_max(self) -> int:
        """The largest class value over every mask (unreadable masks move to `skipped`)."""
        from fastdata.write.encode import DEFAULT_MAX_PIXELS, BadSampleError
        from fastdata.write.sample_fields import read_mask

        top = 0
        for split, pairs in self._pairs.items():
            kept = []
            for image, mask in pairs:
                try:
                    values = read_mask(
                        MaskFile(self.masks / mask), DEFAULT_MAX_PIXELS, str(self.images / image)
                    )
                except BadSampleError as exc:
                    self.skipped.setdefault(split, []).append((exc.origin, exc.reason))
                    continue
                kept.append((image, mask))
                if self.ignore_index is not None:
                    values = values[values != self.ignore_index]
                if values.size:
                    top = max(top, int(values.max()))
            self._pairs[split] = kept
        return top

    def splits(self) -> dict[str, int]:
        """Split name -> number of image/mask pairs."""
        return {split: len(pairs) for split, pairs in self._pairs.items()}

    def sample_fields(self, split: str) -> dict[str, FieldSpec]:
        """One `mask` field."""
        return dict(_FIELDS)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th pair of `split` in path order (the mask is read by the writer)."""
        if split not in self._pairs:
            raise ValueError(f"unknown split {split!r}; {self.images} has {sorted(self._pairs)}")
        pairs = self._pairs[split]
        if not 0 <= index < len(pairs):
            raise IndexError(f"{split}[{index}] is out of range: the split has {len(pairs)} pairs")
        image, mask = pairs[index]
        mask_file = MaskFile(self.masks / mask, len(self.classes), self.ignore_index)
        return SourceItem(
            sample_id=index,
            label=-1,
            origin=str(self.images / image),
            path=self.images / image,
            fields={"mask": mask_file},
            source_id=PurePath(image).as_posix(),  # relative to the images folder, "/" on every OS
        )

    def fingerprint(self) -> dict[str, Any]:
        """Kind, both folders, the pairs' count, total bytes and newest mtime, the classes."""
        sizes = mtime = 0
        for pairs in self._pairs.values():
            for image, mask in pairs:
                for path in (self.images / image, self.masks / mask):
                    try:
                        st = path.stat()
                    except OSError:
                        continue
                    sizes += st.st_size
                    mtime = max(mtime, st.st_mtime_ns)
        return {
            "kind": self.kind,
            "images": str(self.images),
            "masks": str(self.masks),
            "splits": self.splits(),
            "bytes": sizes,
            "max_mtime_ns": mtime,
            "classes": list(self.classes),
            "ignore_index": self.ignore_index,
        }


def _splits(images: Path, masks: Path) -> dict[str, tuple[Path, Path]]:
    """Split -> (image folder, mask folder): split folders when IMAGES has them, else one."""
    found = [d.name for d in _visible_dirs(images) if d.name in SPLIT_NAMES]
    if not found:
        return {_FLAT_SPLIT: (images, masks)}
    missing = [name for name in found if not (masks / name).is_dir()]
    if missing:
        raise BadSourceError(
            f"{images} has split folders {found} but {masks} lacks {missing}: give both folders "
            "the same split layout"
        )
    for name in found:
        if (problem := split_name_problem(name)) is not None:
            raise BadSourceError(f"{images}: {problem}")
    return {name: (images / name, masks / name) for name in found}


def _pair(image_dir: Path, mask_dir: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """((image, mask) paths paired by stem, sorted; (path, reason) of every unpaired file)."""
    lost: list[tuple[str, str]] = []
    images, _ = _images_under(image_dir, lost)
    masks, _ = _images_under(mask_dir, lost)
    by_stem: dict[str, str] = {}
    for path, _ in images:
        stem = os.path.splitext(os.path.relpath(path, image_dir))[0]
        if stem in by_stem:
            lost.append((path, f"another image has the same stem ({by_stem[stem]})"))
            continue
        by_stem[stem] = path
    mask_of: dict[str, str] = {}
    for path, _ in masks:
        rel, ext = os.path.splitext(os.path.relpath(path, mask_dir))
        if ext.lower() != ".png":
            lost.append((path, "not a PNG: masks must be PNG files"))
        elif rel not in by_stem:
            lost.append((path, f"mask without an image (no {rel}.* in {image_dir})"))
        else:
            mask_of[rel] = path
    for stem, path in by_stem.items():
        if stem not in mask_of:
            lost.append((path, f"image without a mask (no {stem}.png in {mask_dir})"))
    pairs = sorted((by_stem[stem], mask) for stem, mask in mask_of.items())
    return pairs, sorted(lost)
