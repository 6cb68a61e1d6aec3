"""COCO-format object detection: a folder of images and an annotations json.

    fastdata shard coco IMAGES ANNOTATIONS.json OUT

The json (e.g. `instances_val2017.json`) holds `images` ({id, file_name, width, height}),
`annotations` ({image_id, category_id, bbox [x, y, w, h], iscrowd}) and `categories`
({id, name}). Each image becomes one sample with two boxes fields:

- `boxes`: the training boxes, xyxy float32 pixels of the stored image, classes = the index of
  the category in the categories sorted by id (`classes` are their names in that order);
- `crowd`: the `iscrowd=1` regions, which are not training boxes (torchvision's detection
  references and DETR drop them) but which COCO evaluation uses to ignore detections.

An image without annotations is kept with zero boxes (COCO counts it). A box reaching outside its
image is clipped to it; one left with no width or height in float32 (the dtype boxes are stored
in) is dropped; the counts are in the source's fingerprint (`stats`, shown in the manifest's
`source`). The json is untrusted: its size (`max_json_bytes`, `--max-json-bytes`) and number of
entries are bounded before and while it is parsed, a file name must stay inside IMAGES, and an
annotation naming an unknown image or category, or an image, category or annotation id listed
twice, is an error naming it.

The json is streamed (`fastdata.write.sources.coco_json`): each annotation is kept as a few numbers as
soon as it is decoded, so opening COCO 2017's 448 MB train json takes a fraction of its size in
memory, not the ~7x of `json.load`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from fastdata.format.fields import FieldSpec
from fastdata.write.sources.base import (
    BadSourceError,
    SourceItem,
    describe_path,
    split_name_problem,
)
from fastdata.write.sources.coco_json import stream_lists

__all__ = ["DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_JSON_BYTES", "CocoSource"]

#: Largest annotations file read: COCO 2017's train instances json is 448 MB; LVIS's 1.1 GB.
DEFAULT_MAX_JSON_BYTES = 2 << 30
#: Most images + annotations + categories (COCO train 2017: 118k images, 860k annotations).
DEFAULT_MAX_ENTRIES = 20_000_000

_FIELDS = {
    "boxes": FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy")),
    "crowd": FieldSpec("crowd", "boxes", ("crowd.npy", "crowd_labels.npy")),
}
_HELP = (
    "Expected a COCO detection json: {'images': [{'id', 'file_name', 'width', 'height'}], "
    "'annotations': [{'image_id', 'category_id', 'bbox': [x, y, w, h], 'iscrowd'}], "
    "'categories': [{'id', 'name'}]}."
)


class CocoSource:
    """COCO detection annotations over a folder of images (one split).

    Args:
        images: the image folder that `file_name`s are relative to.
        annotations: the COCO json file.
        split: the split's name (e.g. "train" for instances_train2017.json, "val" for val2017).
        max_json_bytes: largest json file read (the CLI's `--max-json-bytes`); raise it for a
            trusted file larger than the default 2 GiB.
        max_entries: most images + annotations + categories.

    Raises:
        ValueError: a bad split name.
        BadSourceError: the folder or json is missing or unreadable, too large, not COCO, an
            annotation names an unknown image or category, or an id is listed twice (the
            message names the entry and the file).
    """

    kind = "coco"

    def __init__(
        self,
        images: str | Path,
        annotations: str | Path,
        split: str = "train",
        max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if images is None or annotations is None:
            raise ValueError("CocoSource needs the image folder and the annotations json")
        if (problem := split_name_problem(split)) is not None:
            raise ValueError(f"CocoSource(split=...): {problem}")
        self.images = Path(images).expanduser().resolve()
        self.annotations = Path(annotations).expanduser().resolve()
        self.split = split
        if not self.images.is_dir():
            raise BadSourceError(f"{describe_path(self.images)}: not a folder of images")
        where = str(self.annotations)
        images_list, cats, anns = _read(self.annotations, max_json_bytes, max_entries)
        category_index, self.classes = _categories(cats, where)
        #: The COCO category id behind each class index (recorded in the manifest's class_ids).
        self.class_ids = sorted(category_index, key=category_index.__getitem__)
        self._records = _images(images_list, where)
        anns.check_unique_ids(where)
        # Boxes packed per image (one array for all, offsets per image): forked writer workers
        # share them, and 860k annotations cost ~60 bytes each, not a dict and lists each.
        self._boxes, self._crowd, self.stats = _place(anns, self._records, category_index, where)
        if not self._records:
            raise BadSourceError(f"{where}: lists no images. {_HELP}")

    def splits(self) -> dict[str, int]:
        """{split: number of images} (every listed image, with or without boxes)."""
        return {self.split: len(self._records)}

    def sample_fields(self, split: str) -> dict[str, FieldSpec]:
        """`boxes` and `crowd` (both boxes fields)."""
        return dict(_FIELDS)

    def item(self, split: str, index: int) -> SourceItem:
        """The `index`-th image in image-id order, with its boxes and crowd regions."""
        if split != self.split:
            raise ValueError(f"unknown split {split!r}; {self.annotations} is split {self.split!r}")
        if not 0 <= index < len(self._records):
            raise IndexError(f"{split}[{index}] is out of range: {len(self._records)} images")
        image_id, name, width, height = self._records[index]
        path = self.images / name
        return SourceItem(
            sample_id=index,
            label=-1,
            origin=f"{path} (image id {image_id})",
            path=path,
            fields={"boxes": self._boxes.get(index), "crowd": self._crowd.get(index)},
            size=(height, width),
            source_id=image_id,
        )

    def fingerprint(self) -> dict[str, Any]:
        """Kind, the json's path, size and mtime, the image folder, the classes, box counts."""
        stat = self.annotations.stat()
        return {
            "kind": self.kind,
            "annotations": str(self.annotations),
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "images": str(self.images),
            "split": self.split,
            "classes": list(self.classes),
            "stats": dict(self.stats),
        }


def _read(
    path: Path, max_bytes: int, max_entries: int
) -> tuple[list[tuple[int, str, int, int]], list[Any], _Annotations]:
    """(image records, categories, annotations) of the json, streamed (`coco_json`): each image
    and annotation is checked and kept compact as soon as it is decoded."""
    where = str(path)
    records: list[tuple[int, str, int, int]] = []
    cats: list[Any] = []
    anns = _Annotations()
    lists = ("images", "annotations", "categories")
    for key, n, value in stream_lists(
        path, lists, ("images", "categories"), max_bytes, max_entries, _HELP
    ):
        if key == "images":
            records.append(_image(value, n, where))
        elif key == "annotations":
            anns.add(value, n, where)
        else:
            cats.append(value)
    return records, cats, anns


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int64(value: Any) -> bool:
    """An int that fits the int64 columns ids are kept in (COCO's are far smaller)."""
    return _int(value) and -(1 << 63) <= value < 1 << 63


def _categories(cats: list[Any], where: str) -> tuple[dict[int, int], list[str]]:
    """(category id -> class index, class names), in category-id order."""
    found: dict[int, str] = {}
    for n, cat in enumerate(cats):
        if (
            not isinstance(cat, dict)
            or not _int64(cat.get("id"))
            or not isinstance(cat.get("name"), str)
        ):
            raise BadSourceError(f"{where}: categories[{n}] needs an int 'id' and a str 'name'")
        if cat["id"] in found:
            raise BadSourceError(f"{where}: category id {cat['id']} is listed twice")
        found[cat["id"]] = cat["name"]
    if not found:
        raise BadSourceError(f"{where}: lists no categories. {_HELP}")
    ids = sorted(found)
    return {cid: i for i, cid in enumerate(ids)}, [found[cid] for cid in ids]


def _image(image: Any, n: int, where: str) -> tuple[int, str, int, int]:
    """(id, file name, width, height) of `images[n]`, checked (its name must stay inside)."""
    if not isinstance(image, dict):
        raise BadSourceError(f"{where}: images[{n}] is not an object")
    image_id, name = image.get("id"), image.get("file_name")
    width, height = image.get("width"), image.get("height")
    if not _int64(image_id) or not isinstance(name, str) or not name:
        raise BadSourceError(f"{where}: images[{n}] needs an int 'id' and a 'file_name'")
    if not (_int(width) and _int(height) and 0 < width <= 1 << 16 and 0 < height <= 1 << 16):
        raise BadSourceError(
            f"{where}: image id {image_id} ({name!r}) needs 'width' and 'height' of 1..65536"
        )
    pure = PurePosixPath(name)
    if "\x00" in name or pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise BadSourceError(
            f"{where}: image id {image_id}: file_name {name[:80]!r} must be a relative path "
            "inside the image folder (no '..', no leading '/')"
        )
    return image_id, name, width, height


def _images(
    records: list[tuple[int, str, int, int]], where: str
) -> list[tuple[int, str, int, int]]:
    """The image records sorted by id; an id listed twice is an error."""
    seen: set[int] = set()
    for image_id, *_ in records:
        if image_id in seen:
            raise BadSourceError(f"{where}: image id {image_id} is listed twice")
        seen.add(image_id)
    return sorted(records)


class _Annotations:
    """Every annotation as a few numbers in array columns (~60 bytes each), checked for form as
    it is streamed; whether its image and category exist is checked once all are read
    (`_place`: the json may list annotations first)."""

    def __init__(self) -> None:
        self.ids, self.image_ids, self.category_ids = array("q"), array("q"), array("q")
        self.has_id, self.crowd = bytearray(), bytearray()
        self.boxes = array("d")  # x, y, w, h

    def __len__(self) -> int:
        return len(self.image_ids)

    def name(self, number: int) -> str:
        shown = self.ids[number] if self.has_id[number] else None
        return f"annotation id {shown} (annotations[{number}])"

    def add(self, ann: Any, number: int, where: str) -> None:
        """Keep annotation `number` (raises BadSourceError naming it when malformed)."""
        if not isinstance(ann, dict):
            raise BadSourceError(f"{where}: annotations[{number}] is not an object")
        name = f"annotation id {ann.get('id')!r:.20} (annotations[{number}])"
        image_id, category = ann.get("image_id"), ann.get("category_id")
        if not _int64(image_id):
            raise BadSourceError(
                f"{where}: {name} names image id {image_id!r:.40}, not in 'images'"
            )
        if not _int64(category):
            raise BadSourceError(
                f"{where}: {name} names category id {category!r:.40}, not in 'categories'"
            )
        box = ann.get("bbox")
        if (
            not isinstance(box, list)
            or len(box) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)
            or not all(math.isfinite(v) for v in box)
        ):
            raise BadSourceError(f"{where}: {name}: 'bbox' must be 4 finite numbers [x, y, w, h]")
        crowd = ann.get("iscrowd", 0)
        if crowd not in (0, 1):
            raise BadSourceError(f"{where}: {name}: 'iscrowd' must be 0 or 1, got {crowd!r:.20}")
        ann_id = ann.get("id")
        self.has_id.append(_int64(ann_id))
        self.ids.append(ann_id if _int64(ann_id) else 0)
        self.image_ids.append(image_id)
        self.category_ids.append(category)
        self.boxes.extend(float(v) for v in box)
        self.crowd.append(bool(crowd))

    def check_unique_ids(self, where: str) -> None:
        """Raise BadSourceError naming the first annotation id listed twice: its boxes would be
        stored twice (pycocotools keeps the last one; a duplicated export doubles them)."""
        numbers = np.flatnonzero(np.frombuffer(bytes(self.has_id), dtype=np.uint8))
        ids = np.asarray(self.ids, dtype=np.int64)[numbers]
        order = np.argsort(ids, kind="stable")  # equal ids stay in file order
        repeats = np.flatnonzero(ids[order][1:] == ids[order][:-1]) + 1
        if repeats.size:
            at = repeats[np.argmin(numbers[order][repeats])]  # the earliest second listing
            first, second = numbers[order][at - 1], numbers[order][at]
            raise BadSourceError(
                f"{where}: annotation id {ids[order][at]} is listed twice (annotations[{first}] "
                f"and annotations[{second}]); annotation ids must be unique"
            )


@dataclass(frozen=True)
class _Packed:
    """The boxes of every image in one array, image i's at rows offsets[i]:offsets[i + 1]."""

    boxes: np.ndarray  # float32 (k, 4) xyxy
    labels: np.ndarray  # int64 (k,)
    offsets: np.ndarray  # int64 (images + 1,)

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, stop = self.offsets[index], self.offsets[index + 1]
        return self.boxes[start:stop].copy(), self.labels[start:stop].copy()


def _lookup(known: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, int | None]:
    """(position of each wanted id in the sorted `known`, the first wanted index not there)."""
    pos = np.searchsorted(known, wanted)
    found = known[np.minimum(pos, len(known) - 1)] == wanted if len(known) else wanted != wanted
    missing = np.flatnonzero(~found)
    return pos, int(missing[0]) if missing.size else None


def _place(
    anns: _Annotations,
    records: list[tuple[int, str, int, int]],
    category_index: Mapping[int, int],
    where: str,
) -> tuple[_Packed, _Packed, dict[str, int]]:
    """(training boxes, crowd regions, stats): each annotation's box clipped to its image and
    kept only when it has a positive width and height in float32, the dtype it is stored in (a
    1e-6 px box at x=100 is 0 px there: the loaders would see a box of no size)."""
    image_n, bad = _lookup(
        np.array([r[0] for r in records], dtype=np.int64),
        np.asarray(anns.image_ids, dtype=np.int64),
    )
    if bad is not None:
        raise BadSourceError(
            f"{where}: {anns.name(bad)} names image id {anns.image_ids[bad]}, not in 'images'"
        )
    category_ids = np.array(sorted(category_index), dtype=np.int64)
    labels, bad = _lookup(category_ids, np.asarray(anns.category_ids, dtype=np.int64))
    if bad is not None:
        raise BadSourceError(
            f"{where}: {anns.name(bad)} names category id {anns.category_ids[bad]}, not in "
            f"'categories' (known ids: {category_ids[:20].tolist()})"
        )
    size = np.array([(r[2], r[3]) for r in records], dtype=np.float64).reshape(-1, 2)[image_n]
    xywh = np.asarray(anns.boxes, dtype=np.float64).reshape(-1, 4)
    xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
    clipped = np.clip(xyxy, 0.0, np.concatenate([size, size], axis=1))
    stored = clipped.astype(np.float32)
    keep = (stored[:, 2] > stored[:, 0]) & (stored[:, 3] > stored[:, 1])
    crowd = np.frombuffer(bytes(anns.crowd), dtype=np.uint8).astype(bool)
    packed = []
    for rows in (keep & ~crowd, keep & crowd):
        chosen = np.flatnonzero(rows)
        chosen = chosen[np.argsort(image_n[chosen], kind="stable")]  # file order per image
        counts = np.bincount(image_n[chosen], minlength=len(records))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        packed.append(_Packed(stored[chosen], labels[chosen].astype(np.int64), offsets))
    stats = {
        "boxes": int((keep & ~crowd).sum()),
        "crowd": int((keep & crowd).sum()),
        "clipped": int((keep & (clipped != xyxy).any(axis=1)).sum()),
        "degenerate_dropped": int((~keep).sum()),
        "images_without_boxes": int((np.diff(packed[0].offsets) == 0).sum()),
    }
    return packed[0], packed[1], stats
