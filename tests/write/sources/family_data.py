"""Tiny detection and segmentation datasets for the source and writer tests.

Every image is a dark background with one solid coloured rectangle, so a test can find the
rectangle's pixels after any resize and compare them with the stored box and mask.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fastdata.format.fields import FieldSpec

COLOUR = (230, 40, 30)


def rect_pixels(width: int, height: int, box: tuple[int, int, int, int]) -> np.ndarray:
    """(H, W, 3) uint8: background 10, the xyxy `box` in COLOUR."""
    pixels = np.full((height, width, 3), 10, dtype=np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = COLOUR
    return pixels


def save_image(path: Path, pixels: np.ndarray) -> Path:
    """Save as the suffix says (JPEG at quality 95)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {"quality": 95} if path.suffix == ".jpg" else {}
    Image.fromarray(pixels).save(path, **params)
    return path


def coloured(pixels: np.ndarray) -> np.ndarray:
    """(H, W) bool: the pixels nearer the rectangle's colour than the background's."""
    return pixels[..., 0].astype(np.int32) > (COLOUR[0] + 10) // 2


def pixel_box(mask: np.ndarray) -> np.ndarray:
    """The xyxy box (pixel edges) enclosing the True pixels."""
    ys, xs = np.nonzero(mask)
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=np.float32)


def write_coco(
    root: Path, extra: dict[str, Any] | None = None, ext: str = ".png"
) -> tuple[Path, Path]:
    """A COCO dataset of 4 images (ids 7, 3, 9, 5) and 2 categories (ids 20 "dog", 4 "cat").

    - id 3: one box (cat) and one crowd region (dog);
    - id 5: no annotation;
    - id 7: a box reaching past the right and bottom edges (clipped), and one wholly outside
      (dropped);
    - id 9: a 400 x 300 image with its rectangle at (40, 80)-(200, 240) (dog).
    """
    images = root / "images"
    sizes = {3: (80, 60), 5: (64, 48), 7: (80, 60), 9: (400, 300)}
    rects = {3: (8, 12, 40, 36), 5: (0, 0, 1, 1), 7: (60, 40, 80, 60), 9: (40, 80, 200, 240)}
    for image_id, (w, h) in sizes.items():
        save_image(images / "sub" / f"{image_id:03d}{ext}", rect_pixels(w, h, rects[image_id]))
    data = {
        "images": [
            {"id": i, "file_name": f"sub/{i:03d}{ext}", "width": w, "height": h}
            for i, (w, h) in sizes.items()
        ],
        "categories": [{"id": 20, "name": "dog"}, {"id": 4, "name": "cat"}],
        "annotations": [
            {"id": 1, "image_id": 3, "category_id": 4, "bbox": [8, 12, 32, 24], "iscrowd": 0},
            {"id": 2, "image_id": 3, "category_id": 20, "bbox": [0, 0, 10, 10], "iscrowd": 1},
            {"id": 3, "image_id": 7, "category_id": 20, "bbox": [60, 40, 50, 50], "iscrowd": 0},
            {"id": 4, "image_id": 7, "category_id": 4, "bbox": [90, 5, 10, 10], "iscrowd": 0},
            {"id": 5, "image_id": 9, "category_id": 20, "bbox": [40, 80, 160, 160], "iscrowd": 0},
        ],
    }
    data.update(extra or {})
    ann = root / "instances.json"
    ann.write_text(json.dumps(data))
    return images, ann


def write_segmentation(
    root: Path, count: int = 6, ext: str = ".png", splits: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """`count` image/mask pairs per split (no split folders when `splits` is empty): 400 x 300
    images, rectangle i at (40 + 4i, 80)-(200, 240) with mask value i % 3 + 1 (0 elsewhere, 255
    on a 4-px border row at the bottom: the ignore index). Mask i % 2 == 1 is a palette PNG."""
    images, masks = root / "images", root / "masks"
    for split in splits or ("",):
        for i in range(count):
            box = (40 + 4 * i, 80, 200, 240)
            save_image(images / split / f"a{i:02d}{ext}", rect_pixels(400, 300, box))
            mask = np.zeros((300, 400), dtype=np.uint8)
            mask[box[1] : box[3], box[0] : box[2]] = i % 3 + 1
            mask[296:, :] = 255
            (masks / split).mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(mask, "L")
            if i % 2:
                image = image.convert("P")
                image.putpalette([v for c in range(256) for v in (c, 255 - c, c // 2)])
                image.frombytes(mask.tobytes())
            image.save(masks / split / f"a{i:02d}.png")
    return images, masks


def read_samples(tar: Path, fields: dict[str, FieldSpec]) -> dict[str, dict[str, Any]]:
    """key -> {field: decoded value} of every sample of a shard (images as uint8 arrays)."""
    parts: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar) as t:
        for member in t.getmembers():
            key, ext = member.name.split(".", 1)
            parts.setdefault(key, {})[ext] = t.extractfile(member).read()
    out = {}
    for key, comps in parts.items():
        values = {name: spec.decode(comps) for name, spec in fields.items()}
        values["image"] = np.asarray(Image.open(io.BytesIO(bytes(values["image"]))).convert("RGB"))
        out[key] = values
    return out


def write_large_coco(path: Path, images: int, per_image: int = 7, points: int = 24) -> Path:
    """An annotations-only COCO json shaped like the real one (`info`, `licenses`, polygons of
    `points` xy pairs, areas, mixed key order): `images` images of 640 x 480 with `per_image`
    annotations each, written a chunk at a time. Returns `path`."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        f.write('{"info": {"year": 2017, "version": "1.0"}, "licenses": [{"id": 1, "name": "x"}],')
        f.write('"images": [')
        f.write(
            ",".join(
                json.dumps(
                    {
                        "license": 1,
                        "file_name": f"{i:012d}.jpg",
                        "height": 480,
                        "width": 640,
                        "id": i,
                    }
                )
                for i in range(1, images + 1)
            )
        )
        f.write('], "annotations": [')
        number = 0
        for start in range(1, images + 1, 1000):
            rows = []
            for image_id in range(start, min(start + 1000, images + 1)):
                for _ in range(per_image):
                    number += 1
                    x, y = rng.uniform(0, 500, 2).round(2)
                    w, h = rng.uniform(1, 140, 2).round(2)
                    poly = rng.uniform(0, 480, 2 * points).round(2).tolist()
                    rows.append(
                        json.dumps(
                            {
                                "segmentation": [poly],
                                "area": float(w * h),
                                "iscrowd": 0,
                                "image_id": image_id,
                                "bbox": [x, y, w, h],
                                "category_id": 1 + number % 80,
                                "id": number,
                            }
                        )
                    )
            f.write(("," if start > 1 else "") + ",".join(rows))
        f.write('], "categories": [')
        f.write(",".join(json.dumps({"id": c, "name": f"c{c}"}) for c in range(1, 81)))
        f.write("]}")
    return path
