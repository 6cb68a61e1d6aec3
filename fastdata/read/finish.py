"""A dict batch's device-side augmentation: the preset's regions its loader left applied.

The DataModule's `on_after_batch_transfer` calls `finish_sample` on every dict batch (splits
beyond classification, `fastdata.read.decoders.dict_batch`): the cpu and memory backends apply
every op themselves, so their batches pass through; a batch whose loader left the ops (e.g. one
of equal-size images that the DataModule did not load) has each sample's `Region` drawn from
the plan's batch seed and its image, masks and boxes moved together on the device
(`fastdata.augment.targets.warp_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastdata.augment import Preset
from fastdata.format.fields import FieldSpec
from fastdata.read.decoders.dict_batch import Sample, box_labels_key

__all__ = ["finish_sample"]


def finish_sample(
    batch: Mapping[str, Any],
    fields: Mapping[str, FieldSpec],
    preset: Preset,
    train: bool,
    batch_seed: int,
    applied: int,
    ignore_index: int = 255,
) -> Sample:
    """A dict batch with the preset's ops the loader left applied on its device (`warp_batch`).

    The cpu and memory backends apply every op (`applied` = all of them): the batch is returned
    as it is (a copy of the same type). For a batch whose loader left the ops (`applied` = 0:
    one of equal-size images, e.g. a batch the DataModule did not load), each sample's `Region`
    is drawn from `batch_seed` for the batch's size and the image, masks and boxes move
    together, batched on the device. Normalizing is left to the caller.
    """
    out = type(batch)(batch)
    ops = preset.ops(train)
    if "image" not in out or (applied >= len(ops) and preset.image_size is None):
        return out  # an image-less split's batch has nothing to warp
    image = out["image"]
    n, _, h, w = image.shape
    if n == 0:
        return out
    out_hw = (preset.image_size, preset.image_size) if preset.image_size else (h, w)
    if applied >= len(ops) and (h, w) == out_hw:
        return out
    from fastdata.augment.targets import draw_regions, warp_batch

    regions = draw_regions(preset, train, [(h, w)] * n, out_hw, batch_seed)
    masks = [k for k, f in fields.items() if f.kind == "mask" and k in out]
    boxes = [k for k, f in fields.items() if f.kind == "boxes" and k in out]
    first: dict[str, Any] = {}
    if masks:
        first["masks"] = out[masks[0]]
    if boxes:
        first["boxes"], first["box_labels"] = out[boxes[0]], out[box_labels_key(boxes[0])]
    warped = warp_batch(image, regions, ignore_index=ignore_index, **first)
    out["image"] = warped["image"]
    if masks:
        out[masks[0]] = warped["mask"]
    if boxes:
        out[boxes[0]], out[box_labels_key(boxes[0])] = warped["boxes"], warped["box_labels"]
    for name in masks[1:]:
        out[name] = warp_batch(image, regions, masks=out[name], ignore_index=ignore_index)["mask"]
    for name in boxes[1:]:
        key = box_labels_key(name)
        w2 = warp_batch(image, regions, boxes=out[name], box_labels=out[key])
        out[name], out[key] = w2["boxes"], w2["box_labels"]
    return out
