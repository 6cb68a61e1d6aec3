"""The fields of another tool's shards, inferred from the components their samples hold.

`fastdata index` reads WebDataset tars that carry no fastdata manifest; what a split's samples
hold is then told by their members' extensions, as webdataset's decoders tell it
(`000012.mask.png` -> a `mask` field). This module is that table and the rule; the field kinds
themselves are `fastdata.format.fields`.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastdata.format.fields import GZ_SUFFIX, FieldSpec

__all__ = ["infer_fields"]

# Components a foreign shard's member may carry -> the field they become (`infer_fields`).
_INFER: tuple[tuple[str, str, str], ...] = (
    # (component, field name, kind), first match wins per field name
    ("jpg", "image", "image"),
    ("jpeg", "image", "image"),
    ("png", "image", "image"),
    ("webp", "image", "image"),
    ("rgb", "image", "image"),
    ("mp4", "image", "image"),  # videos: the sample's visual component (`fastdata.format.video`)
    ("webm", "image", "image"),
    ("cls", "label", "label"),
    ("lid", "label", "label"),
    ("labels.npy", "labels", "labels"),
    ("mask.png", "mask", "mask"),
    ("txt", "text", "text"),
    ("json", "json", "json"),
    ("npy", "array", "array"),
    ("ten", "tensors", "tensors"),
)


def infer_fields(components: Iterable[str]) -> dict[str, FieldSpec]:
    """The fields a foreign shard's samples hold, from the components seen in them.

    Components are matched case-insensitively (webdataset lower-cases them: `x.JPG` is a `jpg`)
    and a `*.gz` component by its inner extension (`txt.gz` is a text field, decompressed when
    read); images are never read compressed (`jpg.gz` is left out). Images in several encodings
    (`jpg` in some samples, `png` in others) are one field; `boxes.npy` with `box_labels.npy` is a
    boxes field; every other component becomes an `array`, `text` or `json` field when its
    extension says so, and is otherwise left out (returned nowhere).
    """
    seen: dict[str, list[str]] = {}  # inner lower-case component -> the components spelled so
    for comp in sorted(set(components)):
        inner = comp.lower()
        if inner.endswith(GZ_SUFFIX):
            inner = inner[: -len(GZ_SUFFIX)]
            if inner in ("jpg", "jpeg", "png", "webp", "rgb", "mask.png", "mp4", "webm"):
                continue
        seen.setdefault(inner, []).append(comp)
    found: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    for comp, name, kind in _INFER:
        if comp in seen:
            found.setdefault(name, []).extend(seen[comp])
            kinds[name] = kind
    if "boxes.npy" in seen and "box_labels.npy" in seen:
        found["boxes"] = [seen["boxes.npy"][0], seen["box_labels.npy"][0]]
        kinds["boxes"] = "boxes"
    return {name: FieldSpec(name, kinds[name], tuple(comps)) for name, comps in found.items()}
