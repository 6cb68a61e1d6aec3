"""A sample's fields besides its image, as the writer stores them; `--max-side` shrinking.

A source whose split holds more than an image and a label (`Source.sample_fields`: COCO boxes, a
segmentation mask, multi-label lists, captions) hands the writer each sample's field values in
`SourceItem.fields`. This module turns them into tar components through the field registry
(`fastdata.format.fields.FieldSpec.encode`), reads mask files (`MaskFile`) in the writer's worker,
checks that a mask has its image's size, and moves masks (nearest) and boxes (scaled) with an
image that `--max-side` shrank, so every target stays aligned with the pixels it describes.

Classification samples never come here: their components are `fastdata.format.schema.components`.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fastdata.format import schema
from fastdata.format.fields import MAX_MASK_PIXELS, FieldError, FieldSpec, read_mask_png
from fastdata.write.diagnose import not_an_image, sniff_format
from fastdata.write.encode import BadSampleError, EncodedSample, shrink
from fastdata.write.images import UnreadableImage, clean_message, open_image, to_rgb
from fastdata.write.sources.base import MaskFile, SourceItem

__all__ = [
    "encode_with_fields",
    "read_mask",
    "sample_classes",
    "sample_components",
    "shrink_encoded",
]


def shrink_encoded(
    encoded: EncodedSample, max_side: int, quality: int, origin: str
) -> EncodedSample:
    """The image no larger than `max_side` on its longer side (FFCV's `max_resolution`).

    An image already small enough is returned as it is (its bytes untouched); a larger one is
    decoded, resized (Pillow-SIMD, bicubic with a reducing gap: antialiased) and stored again as
    JPEG at `quality` (PNG stays PNG, raw stays raw).

    Raises:
        BadSampleError: the stored bytes cannot be decoded again (names `origin`).
    """
    height, width = encoded.height, encoded.width
    if max(height, width) <= max_side:
        return encoded
    if encoded.ext == schema.RAW_EXT:
        pixels = np.frombuffer(encoded.data, dtype=np.uint8).reshape(height, width, 3)
        image = Image.fromarray(pixels, "RGB")
    else:
        try:
            image = to_rgb(open_image(encoded.data).image)
        except UnreadableImage as exc:
            raise BadSampleError(origin, exc.reason) from exc
    small = shrink(image, max_side, longer=True)
    if encoded.ext == schema.RAW_EXT:
        return EncodedSample(encoded.ext, np.asarray(small).tobytes(), small.height, small.width)
    out = io.BytesIO()
    if encoded.ext == "png":
        small.save(out, "PNG", compress_level=1)
    else:
        small.save(out, "JPEG", quality=quality)
    return EncodedSample(
        "png" if encoded.ext == "png" else "jpg", out.getvalue(), small.height, small.width
    )


def read_mask(mask: MaskFile, max_pixels: int | None, origin: str) -> np.ndarray:
    """A mask file as an (H, W) uint8 or uint16 class map.

    Raises:
        BadSampleError: missing or unreadable file, not a PNG, several channels, larger than
            `max_pixels`, or a value that is neither a class nor the ignore index (names the
            mask file and the image `origin`).
    """
    where = f"{origin}: mask {mask.path}"
    try:
        data = Path(mask.path).read_bytes()
    except OSError as exc:
        raise BadSampleError(where, f"cannot read the mask ({exc.strerror or exc})") from exc
    try:
        # Never more than the readers accept (MAX_MASK_PIXELS), also where max_pixels is None.
        bound = min(max_pixels or MAX_MASK_PIXELS, MAX_MASK_PIXELS)
        values = read_mask_png(data, bound, _mask_problem)
    except FieldError as exc:
        raise BadSampleError(where, str(exc).removeprefix("mask: ")) from exc
    if mask.num_classes is not None:
        classes = values[values != mask.ignore_index] if mask.ignore_index is not None else values
        if classes.size and int(classes.max()) >= mask.num_classes:
            raise BadSampleError(
                where,
                f"mask value {int(classes.max())} is not one of the {mask.num_classes} classes"
                + (
                    f" nor the ignore index {mask.ignore_index}"
                    if mask.ignore_index is not None
                    else ""
                )
                + "; fix the mask or the class list (--classes)",
            )
    return values


def sample_components(
    item: SourceItem,
    specs: Mapping[str, FieldSpec],
    encoded: EncodedSample,
    original: tuple[int, int],
    max_pixels: int | None,
) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The tar components of a sample with fields, and the field values as stored.

    Args:
        item: the source item (its `fields` hold a value for every spec).
        specs: the split's fields besides the image.
        encoded: the stored image (after `shrink_encoded`).
        original: (height, width) of the image before shrinking: masks must have this size,
            boxes are in its pixels.
        max_pixels: bound on a mask file's pixels.

    Raises:
        BadSampleError: a field value is missing, cannot be encoded, or a mask's size differs
            from its image's (the message names both files).
    """
    values = dict(item.fields or {})
    parts: dict[str, bytes] = {encoded.ext: encoded.data}
    stored: dict[str, Any] = {}
    new = (encoded.height, encoded.width)
    for name, spec in specs.items():
        if name not in values:
            raise BadSampleError(item.origin, f"the source gave no value for field {name!r}")
        value = values[name]
        try:
            if spec.kind == "label":
                label = int(value)
                parts["cls"] = str(label).encode()
                parts["lid"] = schema.encode_lid(label, item.sample_id)
                stored[name] = label
                continue
            if spec.kind == "mask":
                value = _mask_value(item, value, original, new, max_pixels)
            elif spec.kind == "boxes":
                value = _scaled_boxes(value, original, new)
            parts.update(spec.encode(value))
            stored[name] = value
        except FieldError as exc:
            raise BadSampleError(item.origin, f"field {name!r}: {exc}") from exc
    return parts, stored


def _mask_problem(exc: Exception, data: bytes) -> str:
    """Why Pillow could not read a mask, without the `<_io.BytesIO object at 0x...>` that its
    "cannot identify image file" names instead of the file (`where` names the file)."""
    if isinstance(exc, Image.UnidentifiedImageError):
        fmt = sniff_format(data)
        return f"a {fmt} file Pillow cannot identify" if fmt else not_an_image(data)
    return clean_message(exc)


def _mask_value(
    item: SourceItem,
    value: Any,
    original: tuple[int, int],
    new: tuple[int, int],
    max_pixels: int | None,
) -> np.ndarray:
    if isinstance(value, MaskFile):
        mask = read_mask(value, max_pixels, item.origin)
        where = f"{item.origin} and mask {value.path}"
    else:
        mask, where = np.asarray(value), item.origin
    if mask.shape != original:
        raise BadSampleError(
            where,
            f"the mask is {mask.shape[1]} x {mask.shape[0]} (W x H) but the image is "
            f"{original[1]} x {original[0]}; a mask must have its image's size",
        )
    if new != original:  # --max-side shrank the image: nearest keeps the classes exact
        image = Image.fromarray(np.ascontiguousarray(mask))  # uint8 -> L, uint16 -> I;16
        mask = np.asarray(image.resize((new[1], new[0]), Image.NEAREST)).astype(mask.dtype)
    return mask


def _scaled_boxes(
    value: Any, original: tuple[int, int], new: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The boxes as stored: float32 xyxy in the stored image's pixels, only those with a positive
    width and height in float32 (what the loaders keep; a box 1e-6 px wide at x=100 has none)."""
    boxes, labels = value
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if not np.isfinite(boxes).all():
        raise FieldError("boxes: every coordinate must be a finite number")
    if new != original:
        sy, sx = new[0] / original[0], new[1] / original[1]
        boxes = (boxes * np.array([sx, sy, sx, sy], dtype=np.float64)).astype(np.float32)
    if labels.shape[0] != boxes.shape[0]:
        return boxes, labels  # the field's encoder names the mismatch
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return boxes[keep], labels[keep]


def sample_classes(
    specs: Mapping[str, FieldSpec], stored: Mapping[str, Any], num_classes: int
) -> set[int]:
    """The classes a sample holds, each counted once (the manifest's per-class sample counts):
    its label, its labels, its boxes' classes and its mask's values below `num_classes` (an
    ignore index such as 255 is not a class)."""
    found: set[int] = set()
    for name, spec in specs.items():
        value = stored.get(name)
        if value is None:
            continue
        if spec.kind == "label":
            found.add(int(value))
        elif spec.kind == "labels":
            found.update(int(v) for v in np.asarray(value).reshape(-1))
        elif spec.kind == "boxes":
            found.update(int(v) for v in np.asarray(value[1]).reshape(-1))
        elif spec.kind == "mask":
            found.update(int(v) for v in np.unique(value))
    return {c for c in found if 0 <= c < num_classes}


def encode_with_fields(
    item: SourceItem,
    specs: Mapping[str, FieldSpec] | None,
    encoded: EncodedSample,
    max_side: int | None,
    quality: int,
    max_pixels: int | None,
    num_classes: int,
) -> tuple[EncodedSample, dict[str, bytes] | None, set[int]]:
    """Check the image's size against the source's, shrink it (`max_side`) and build the
    components of a sample with fields: (stored image, components or None for a classification
    sample, which the writer lays out itself, classes the sample holds).

    Raises:
        BadSampleError: see `sample_components`, or the image's size differs from the one the
            source recorded (a COCO record's width and height).
    """
    original = (encoded.height, encoded.width)
    if item.size is not None and tuple(item.size) != original:
        raise BadSampleError(
            item.origin,
            f"the image is {original[1]} x {original[0]} (W x H) but the annotations say "
            f"{item.size[1]} x {item.size[0]}; their boxes would not fit it",
        )
    if max_side is not None:
        encoded = shrink_encoded(encoded, max_side, quality, item.origin)
    if specs is None:
        return encoded, None, {item.label}
    parts, stored = sample_components(item, specs, encoded, original, max_pixels)
    return encoded, parts, sample_classes(specs, stored, num_classes)
