"""What `fastdata index` records about one split: its fields, image sizes and label order.

`split_info` turns a split's scanned tars (`fastdata.write.foreign.ScannedTar`) into its
manifest entry: the fields its components hold (`fastdata.format.field_inference.infer_fields`; a split without
images is one too), `image_stats` and `raw_shape` from the sizes read from the images' headers
(as `fastdata shard` records them, so the DataModule's default size is the same for foreign and
own shards), and the checks that every reader of the split would otherwise fail later.
`label_order` measures how ordered its labels are within its tars.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

from fastdata.format.field_inference import infer_fields
from fastdata.format.fields import FieldSpec, is_classification
from fastdata.format.manifest import ShardInfo, SplitInfo
from fastdata.format.schema import IMAGE_EXTS, VIDEO_ENCODING
from fastdata.format.video import VIDEO_EXTS
from fastdata.write.foreign import ScannedTar
from fastdata.write.locate import IndexingError

__all__ = ["ORDERED_LABELS", "label_order", "split_info", "warn_ordered"]

log = logging.getLogger("fastdata")

#: `label_order` above which `fastdata index` warns that a split's labels look ordered.
ORDERED_LABELS = 0.5


def split_info(split: str, tars: list[ScannedTar], num_classes: int) -> SplitInfo:
    components = {c for tar in tars for comps in tar.components for c in comps}
    fields = infer_fields(components)
    if not fields:
        raise IndexingError(
            f"split {split!r} ({tars[0].name}, ...) holds no component a reader knows (jpg, png, "
            f"cls, txt, json, npy, their .gz); found {sorted(components)}"
        )
    image = fields.get("image")
    _check_image(split, tars, fields)
    _check_samples(tars, fields)
    counts = [0] * num_classes
    for tar in tars:
        for label in tar.labels:
            if label is not None:
                counts[label] += 1
    exts = {c.lower() for c in image.components} if image is not None else set()
    encoding = "jpeg" if exts == {"jpg"} else "png" if exts == {"png"} else "mixed"
    if exts and exts <= set(VIDEO_EXTS):
        encoding = VIDEO_ENCODING  # read as clips (`VideoDataModule`); indexes read on first use
    plain = is_classification(fields) and (
        set(image.components) <= {"jpg", "png"} or encoding == VIDEO_ENCODING  # type: ignore[union-attr]
    )
    stats, raw_shape = _image_stats(tars) if image is not None else ({}, None)
    shards = [
        ShardInfo(
            name=tar.name,
            index=tar.name.removesuffix(".tar") + ".idx",
            num_samples=tar.num_samples,
            bytes=tar.bytes,
            sha256=tar.sha256,
            index_sha256=_sha(tar.index_text),
            sums=tar.name.removesuffix(".tar") + ".sum",
            sums_sha256=_sha(tar.sums_text),
        )
        for tar in tars
    ]
    return SplitInfo(
        shards=shards,
        class_counts=counts if "label" in fields else [],
        encoding=encoding,
        raw_shape=raw_shape,
        image_stats=stats,
        fields=None if plain else fields,
    )


def _check_image(split: str, tars: list[ScannedTar], fields: dict[str, FieldSpec]) -> None:
    """Refuse what no reader of an image split can read (names the split and what to do)."""
    image = fields.get("image")
    if image is None:
        if any(f.kind in ("mask", "boxes") for f in fields.values()):
            raise IndexingError(
                f"split {split!r} ({tars[0].name}, ...) holds masks or boxes but no image "
                "(jpg, png) to place them on; add the images or leave those members out"
            )
        return
    exts = {c.lower() for c in image.components}
    videos = exts & set(VIDEO_EXTS)
    if videos and (exts - videos or not is_classification(fields)):
        raise IndexingError(
            f"split {split!r} ({tars[0].name}, ...): video members ({sorted(videos)}) beside "
            f"{sorted((exts - videos) | (set(fields) - {'image', 'label'}))}; a video split "
            "holds a video and a label per sample: keep the other members in other tars"
        )
    if videos:
        return
    if "rgb" in exts:
        raise IndexingError(
            f"split {split!r}: 'rgb' members (raw pixels) carry no shape a reader could use; "
            "store the images encoded (jpg, png)"
        )
    if "webp" in exts:  # the readers' Pillow-SIMD has no WebP decoder
        raise IndexingError(
            f"split {split!r} ({tars[0].name}, ...): 'webp' images cannot be decoded by the "
            "readers (Pillow-SIMD has no WebP); re-shard them with `fastdata shard list`, which "
            "converts WebP to PNG"
        )
    odd = set(image.components) - set(IMAGE_EXTS)
    if is_classification(fields) and odd:
        raise IndexingError(
            f"split {split!r} ({tars[0].name}, ...): image members with component(s) "
            f"{sorted(odd)}; the image + label readers (every backend) look for "
            f"{'/'.join(IMAGE_EXTS)} as spelled: rename them in lower case (e.g. x.JPG -> x.jpg)"
        )
    label = fields.get("label")
    if is_classification(fields) and label is not None and set(label.components) - {"cls", "lid"}:
        raise IndexingError(
            f"split {split!r} ({tars[0].name}, ...): its labels are stored as "
            f"{'/'.join(label.components)}; the image + label readers (every backend) read "
            "'cls' as it is: store 'cls' uncompressed (a class index is a few bytes)"
        )


def _image_stats(tars: list[ScannedTar]) -> tuple[dict[str, float], list[int] | None]:
    """(image_stats, raw_shape) from the sizes read from the images' headers, as
    `fastdata shard` records them; ({}, None) when some header could not be read."""
    sizes = [size for tar in tars for size in tar.sizes]
    if not sizes or any(size is None for size in sizes):
        return {}, None
    heights = [h for h, _ in sizes]  # type: ignore[misc]
    widths = [w for _, w in sizes]  # type: ignore[misc]
    stats = {
        "min_height": min(heights),
        "max_height": max(heights),
        "mean_height": round(sum(heights) / len(heights), 2),
        "min_width": min(widths),
        "max_width": max(widths),
        "mean_width": round(sum(widths) / len(widths), 2),
    }
    same = len(set(heights)) == 1 and len(set(widths)) == 1
    return stats, [heights[0], widths[0], 3] if same else None


def label_order(tars: list[ScannedTar]) -> float | None:
    """How ordered a split's labels are within its tars: 0 as shuffled, 1 sorted; None with
    fewer than two labels or one class.

    The share of adjacent same-label pairs (within a tar) `a` against what a shuffle gives,
    `e` = sum of squared class shares, scaled so a shuffle reads 0 and a sorted tar 1:
    (a - e) / (1 - e).
    """
    labels = [[x for x in tar.labels if x is not None] for tar in tars]
    pairs = sum(max(len(x) - 1, 0) for x in labels)
    total = sum(len(x) for x in labels)
    if pairs == 0:
        return None
    same = sum(a == b for x in labels for a, b in zip(x, x[1:], strict=False))
    counts: dict[int, int] = {}
    for x in labels:
        for label in x:
            counts[label] = counts.get(label, 0) + 1
    expected = sum((n / total) ** 2 for n in counts.values())
    if expected >= 1.0:
        return None
    return round(max((same / pairs - expected) / (1 - expected), 0.0), 3)


def warn_ordered(order_of: dict[str, float | None], scanned: dict[str, list[ScannedTar]]) -> None:
    for split, order in order_of.items():
        if order is not None and order > ORDERED_LABELS:
            log.warning(
                "split %r: its labels look ordered within its tars (label_order %.2f; 0 is as "
                "shuffled, 1 sorted; e.g. %s): a loader that reads each batch from one or two "
                "tars sees few classes per batch; train with ShardDataModule(shuffle='window') "
                "(the default: batches span many tars) or shuffle='full', not shuffle='shard'",
                split,
                order,
                scanned[split][0].name,
            )


def _check_samples(tars: Iterable[ScannedTar], fields: dict[str, FieldSpec]) -> None:
    """Every sample holds every field (an image or label in any of its components)."""
    for tar in tars:
        for key, comps in zip(tar.keys, tar.components, strict=True):
            have = set(comps)
            for spec in fields.values():
                some = spec.kind in ("image", "label")
                ok = bool(have & set(spec.components)) if some else set(spec.components) <= have
                if not ok:
                    raise IndexingError(
                        f"{tar.name}: sample {key!r} has no {spec.name} ({'/'.join(spec.components)}) "
                        f"while other samples of its split do (it has {sorted(have)}); a reader "
                        "would fail on it: fix or drop the sample"
                    )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
