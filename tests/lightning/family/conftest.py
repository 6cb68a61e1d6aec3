"""Dict-dataset fixtures: shards of solid-colour rectangles whose box and mask are the target.

Each image is black with one solid rectangle of a class's colour (pure white, so a resized
image's coloured pixels are those above mid-grey). The rectangle's box (xyxy, pixel edges) is
the detection target, its pixels (value = class + 1 on 0) the mask; every sample also holds a
multi-label list, a caption and a json record naming it, so each arrives with its own sample.
Written with `fastdata.write.tarshard` + `FieldSpec.encode` + `Manifest(fields=...)`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.format.fields import FieldSpec
from fastdata.format.manifest import Manifest, ShardInfo, SplitInfo
from fastdata.write.tarshard import ShardTarWriter, sha256_file

NUM_CLASSES = 5
IGNORE = 255

ALL_FIELDS = {
    "image": FieldSpec("image", "image", ("png",)),
    "mask": FieldSpec("mask", "mask", ("mask.png",)),
    "boxes": FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy")),
    "labels": FieldSpec("labels", "labels", ("labels.npy",)),
    "caption": FieldSpec("caption", "text", ("txt",)),
    "meta": FieldSpec("meta", "json", ("json",)),
}


@dataclass(frozen=True)
class Rect:
    """One sample: image size, rectangle (x0, y0, x1, y1 exclusive ends), class."""

    key: str
    hw: tuple[int, int]
    box: tuple[int, int, int, int]
    cls: int


def rectangles(n: int, seed: int, *, sizes=(24, 48), fixed: tuple[int, int] | None = None):
    """`n` random rectangles in images of random (or `fixed`) size; some touch the border."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = fixed or (int(rng.integers(*sizes)), int(rng.integers(*sizes)))
        rh, rw = int(rng.integers(3, h // 2 + 2)), int(rng.integers(3, w // 2 + 2))
        y0 = 0 if i % 7 == 3 else int(rng.integers(0, h - rh + 1))
        x0 = w - rw if i % 5 == 2 else int(rng.integers(0, w - rw + 1))
        out.append(Rect(f"s{seed}_{i:05d}", (h, w), (x0, y0, x0 + rw, y0 + rh), i % NUM_CLASSES))
    return out


def edge_rectangles(seed: int, n: int = 12) -> list[Rect]:
    """Samples of mixed aspect ratios (wide, tall, square, thin strips) whose rectangles touch
    the image's edges: a centre window or a shared stored size would cut them. The first is the
    issue-29 repro (a 300 x 150 image, box [0, 50, 40, 40] in COCO's xywh)."""
    rng = np.random.default_rng(seed)
    fixed = [
        Rect(f"e{seed}_00000", (150, 300), (0, 50, 40, 90), 1),
        Rect(f"e{seed}_00001", (200, 200), (160, 0, 200, 30), 2),
        Rect(f"e{seed}_00002", (300, 90), (0, 270, 90, 300), 3),
        Rect(f"e{seed}_00003", (40, 160), (150, 10, 160, 40), 4),
    ]
    out = list(fixed)
    shapes = [(30, 90), (90, 30), (50, 50), (24, 100), (100, 24), (64, 40)]
    for i in range(len(fixed), n):
        h, w = shapes[i % len(shapes)]
        rh, rw = int(rng.integers(3, h // 2 + 2)), int(rng.integers(3, w // 2 + 2))
        side = i % 4  # the rectangle touches the left, right, top or bottom edge
        x0 = 0 if side == 0 else w - rw if side == 1 else int(rng.integers(0, w - rw + 1))
        y0 = 0 if side == 2 else h - rh if side == 3 else int(rng.integers(0, h - rh + 1))
        out.append(Rect(f"e{seed}_{i:05d}", (h, w), (x0, y0, x0 + rw, y0 + rh), i % NUM_CLASSES))
    return out


def sample_components(rect: Rect, fields=ALL_FIELDS) -> dict[str, bytes]:
    """The tar components of one rectangle sample."""
    h, w = rect.hw
    x0, y0, x1, y1 = rect.box
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[y0:y1, x0:x1] = 255
    mask = np.zeros((h, w), np.uint8)
    mask[y0:y1, x0:x1] = rect.cls + 1
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    values = {
        "image": ("png", buf.getvalue()),
        "mask": mask,
        "boxes": (np.array([rect.box], np.float32), np.array([rect.cls], np.int64)),
        "labels": np.array(sorted({rect.cls, (rect.cls + 2) % NUM_CLASSES})),
        "caption": f"a white box of class {rect.cls} in {rect.key}",
        "meta": {"key": rect.key, "cls": rect.cls},
    }
    parts: dict[str, bytes] = {}
    for name, spec in fields.items():
        parts.update(spec.encode(values[name]))
    return parts


def write_field_shards(
    out: Path, splits: dict[str, list[Rect]], fields=ALL_FIELDS, per_shard: int = 16, edit=None
) -> Path:
    """Shards + index files + manifest.json (with `fields`) of the given samples in `out`;
    `edit(rect, components)` may change a sample's components (to corrupt one)."""
    out.mkdir(parents=True, exist_ok=True)
    infos = {}
    for split, rects in splits.items():
        shards = []
        for s, start in enumerate(range(0, len(rects), per_shard)):
            name = f"{split}-{s:06d}"
            writer = ShardTarWriter(out / f"{name}.tar", out / f"{name}.idx")
            for rect in rects[start : start + per_shard]:
                parts = sample_components(rect, fields)
                writer.write(rect.key, edit(rect, parts) if edit else parts)
            size, sha = writer.commit()
            idx = sha256_file(out / f"{name}.idx")
            shards.append(
                ShardInfo(f"{name}.tar", f"{name}.idx", writer.num_samples, size, sha, None, idx)
            )
        counts = [0] * NUM_CLASSES
        for rect in rects:
            counts[rect.cls] += 1
        hws = {r.hw for r in rects}
        infos[split] = SplitInfo(
            shards=shards,
            class_counts=counts,
            encoding="png",
            raw_shape=[*next(iter(hws)), 3] if len(hws) == 1 else None,
            fields=dict(fields),
        )
    classes = [f"class{c}" for c in range(NUM_CLASSES)]
    manifest = Manifest(
        root=str(out),
        classes=classes,
        splits=infos,
        source={"kind": "test-rectangles"},
        seed=0,
        fastdata_version="test",
    )
    manifest.save(out)
    return out


@pytest.fixture
def rect_splits() -> dict[str, list[Rect]]:
    return {"train": rectangles(40, 1), "val": rectangles(13, 2)}


@pytest.fixture
def rect_shards(tmp_path: Path, rect_splits) -> Path:
    """40 train + 13 val rectangle samples of random sizes, every field kind, shards of 16."""
    return write_field_shards(tmp_path / "rects", rect_splits)
