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
image is clipped to it; one left with no width or height is dropped; the counts are in the
source's fingerprint (`stats`, shown in the manifest's `source`). The json is untrusted: its size
and number of entries are bounded before and while it is parsed, a file name must stay inside
IMAGES, and an annotation naming an unknown image or category is an error naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from fastdata.fields import FieldSpec
from fastdata.sources.base import BadSourceError, SourceItem, describe_path, split_name_problem

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
        max_json_bytes: largest json file read.
        max_entries: most images + annotations + categories.

    Raises:
        ValueError: a bad split name.
        BadSourceError: the folder or json is missing or unreadable, too large, not COCO, or an
            annotation names an unknown image or category (the message names the entry).
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
        data = _load_json(self.annotations, max_json_bytes)
        where = str(self.annotations)
        images_list, anns, cats = (
            _list(data, key, where) for key in ("images", "annotations", "categories")
        )
        if len(images_list) + len(anns) + len(cats) > max_entries:
            raise BadSourceError(
                f"{where}: {len(images_list):,} images + {len(anns):,} annotations + "
                f"{len(cats):,} categories is more than max_entries={max_entries:,}"
            )
        category_index, self.classes = _categories(cats, where)
        #: The COCO category id behind each class index (recorded in the manifest's class_ids).
        self.class_ids = sorted(category_index, key=category_index.__getitem__)
        self._records = _images(images_list, where)
        by_id = {record[0]: n for n, record in enumerate(self._records)}
        boxes: list[list[list[float]]] = [[] for _ in self._records]
        labels: list[list[int]] = [[] for _ in self._records]
        crowd: list[list[list[float]]] = [[] for _ in self._records]
        crowd_labels: list[list[int]] = [[] for _ in self._records]
        self.stats = {"boxes": 0, "crowd": 0, "clipped": 0, "degenerate_dropped": 0}
        for number, ann in enumerate(anns):
            image_n, label, box, is_crowd = _annotation(ann, number, where, by_id, category_index)
            _, _, width, height = self._records[image_n]
            clipped = _clip(box, width, height)
            if clipped is None:
                self.stats["degenerate_dropped"] += 1
                continue
            self.stats["clipped"] += clipped != _xyxy(box)
            if is_crowd:
                crowd[image_n].append(clipped)
                crowd_labels[image_n].append(label)
                self.stats["crowd"] += 1
            else:
                boxes[image_n].append(clipped)
                labels[image_n].append(label)
                self.stats["boxes"] += 1
        self.stats["images_without_boxes"] = sum(1 for b in boxes if not b)
        # Arrays per image: forked writer workers share them.
        self._boxes = [_pair(b, lab) for b, lab in zip(boxes, labels, strict=True)]
        self._crowd = [_pair(b, lab) for b, lab in zip(crowd, crowd_labels, strict=True)]
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
            fields={"boxes": self._boxes[index], "crowd": self._crowd[index]},
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


def _load_json(path: Path, max_bytes: int) -> Any:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BadSourceError(
                f"{path}: {size:,} bytes is more than max_json_bytes={max_bytes:,}; raise it if "
                "the file is trusted"
            )
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise BadSourceError(f"{describe_path(path)}: cannot read ({exc.strerror or exc})") from exc
    if len(data) > max_bytes:
        raise BadSourceError(f"{path}: more than max_json_bytes={max_bytes:,} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadSourceError(f"{path}: not valid JSON ({exc}). {_HELP}") from None


def _list(data: Any, key: str, where: str) -> list[Any]:
    if not isinstance(data, dict):
        raise BadSourceError(f"{where}: expected a JSON object. {_HELP}")
    value = data.get(key, [] if key == "annotations" else None)
    if not isinstance(value, list):
        raise BadSourceError(f"{where}: {key!r} must be a list. {_HELP}")
    return value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _categories(cats: list[Any], where: str) -> tuple[dict[int, int], list[str]]:
    """(category id -> class index, class names), in category-id order."""
    found: dict[int, str] = {}
    for n, cat in enumerate(cats):
        if (
            not isinstance(cat, dict)
            or not _int(cat.get("id"))
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


def _images(images: list[Any], where: str) -> list[tuple[int, str, int, int]]:
    """(id, file name, width, height) per image, sorted by id; names checked to stay inside."""
    records = []
    seen: set[int] = set()
    for n, image in enumerate(images):
        if not isinstance(image, dict):
            raise BadSourceError(f"{where}: images[{n}] is not an object")
        image_id, name = image.get("id"), image.get("file_name")
        width, height = image.get("width"), image.get("height")
        if not _int(image_id) or not isinstance(name, str) or not name:
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
        if image_id in seen:
            raise BadSourceError(f"{where}: image id {image_id} is listed twice")
        seen.add(image_id)
        records.append((image_id, name, width, height))
    return sorted(records)


def _annotation(
    ann: Any, number: int, where: str, by_id: Mapping[int, int], categories: Mapping[int, int]
) -> tuple[int, int, list[float], bool]:
    """(image number, class index, [x, y, w, h], crowd) of one annotation, checked."""
    if not isinstance(ann, dict):
        raise BadSourceError(f"{where}: annotations[{number}] is not an object")
    name = f"annotation id {ann.get('id')!r:.20} (annotations[{number}])"
    image_id, category = ann.get("image_id"), ann.get("category_id")
    if not _int(image_id) or image_id not in by_id:
        raise BadSourceError(f"{where}: {name} names image id {image_id!r:.40}, not in 'images'")
    if not _int(category) or category not in categories:
        raise BadSourceError(
            f"{where}: {name} names category id {category!r:.40}, not in 'categories' "
            f"(known ids: {sorted(categories)[:20]})"
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
    return by_id[image_id], categories[category], [float(v) for v in box], bool(crowd)


def _xyxy(box: list[float]) -> list[float]:
    x, y, w, h = box
    return [x, y, x + w, y + h]


def _clip(box: list[float], width: int, height: int) -> list[float] | None:
    """The xyxy box clipped to the image, or None when nothing of it is left."""
    x0, y0, x1, y1 = _xyxy(box)
    x0, x1 = min(max(x0, 0.0), width), min(max(x1, 0.0), width)
    y0, y1 = min(max(y0, 0.0), height), min(max(y1, 0.0), height)
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        return None
    return [x0, y0, x1, y1]


def _pair(boxes: list[list[float]], labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        np.asarray(labels, dtype=np.int64).reshape(-1),
    )
