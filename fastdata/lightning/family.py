"""The DataModule family: segmentation and detection over the same contract as classification.

`ShardDataModule` reads any split; these subclasses carry a task's defaults and checks:

- `SegmentationDataModule`: splits with an image and a `mask` field. Dict batches with ``image``
  float (N, 3, S, S) after `on_after_batch_transfer` and ``mask`` int64 (N, S, S); the preset's
  crops and flips move the mask with the image (nearest), pixels outside the image (a pad-crop)
  and evaluation padding samples are `ignore_index`.
- `DetectionDataModule`: splits with an image and a `boxes` field. ``boxes`` a list of float32
  (k_i, 4) xyxy pixel boxes of the output image, ``box_labels`` a list of int64 (k_i,); evaluation
  padding samples have no boxes. The default augmentation resizes the whole image to
  ``image_size`` squared and flips it half of the time (`detection_preset`): no crop, so no box
  is cut or lost (a random-resized crop keeps 8-100% of an image and would drop most boxes of a
  small-object dataset); pass ``train_transforms="photo"`` for crops.

Neither defines a constructor: their options are `ShardDataModule`'s typed keywords, one
signature that Python, documentation tools and LightningCLI read alike (a task's own default is
a hook, `_default_train_transforms`). Everything underneath is `ShardDataModule`'s: one epoch plan for every backend (cpu and memory
carry every field, and give the same sample in every field: the memory backend keeps each image,
mask and box list at its own size, `fastdata.read.backends.memory_dict`), mid-epoch resume, ranks, mixes of datasets, ``on_error``; every batch also
holds ``padded`` (bool (N,)) for metrics to skip evaluation padding.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastdata.augment import IMAGENET_MEAN, IMAGENET_STD, Flip, Preset
from fastdata.format.manifest import SplitInfo
from fastdata.lightning.datamodule import ShardDataModule

__all__ = ["DetectionDataModule", "SegmentationDataModule", "detection_preset"]


def detection_preset(image_size: int | None = None, flip_p: float = 0.5) -> Preset:
    """Detection's default: the whole image resized to `image_size` squared, flipped with
    probability `flip_p` in training (boxes follow); evaluation: just the resize."""
    return Preset(
        "detection", image_size, IMAGENET_MEAN, IMAGENET_STD, (Flip(flip_p),) if flip_p else ()
    )


class _TaskDataModule(ShardDataModule):
    """A `ShardDataModule` whose splits must hold one field kind (its target)."""

    target_kind = ""
    task = ""

    def _check_fields(self, roles: Mapping[str, SplitInfo]) -> None:
        for role, info in roles.items():
            fields = info.field_specs
            if any(f.kind == self.target_kind for f in fields.values()):
                continue
            held = ", ".join(f"{n} ({f.kind})" for n, f in fields.items())
            raise ValueError(
                f"{type(self).__name__} needs a {self.target_kind!r} field in every split, but "
                f"the {role} split {self.split_names[role]!r} of {self.root} holds {held}; "
                f"write {self.task} shards (e.g. `fastdata shard "
                f"{'segmentation' if self.task == 'segmentation' else 'coco'} ...`), or read "
                "this dataset with ShardDataModule"
            )


class SegmentationDataModule(_TaskDataModule):
    """Semantic segmentation: dict batches with ``image`` and ``mask`` (see the module doc).

    Its options are `ShardDataModule`'s, the same typed keywords (its signature, for
    LightningCLI too): ``ignore_index`` (default 255) is the mask value of pixels a pad-crop
    adds outside the image and of every pixel of an evaluation padding sample; pass the same to
    ``cross_entropy(..., ignore_index=...)``. The default augmentation is `ShardDataModule`'s
    (`fastdata.augment.default_preset`: "cifar" for small fixed-size images, else "photo":
    random-resized crop and flip), applied to image and mask alike.

    Raises:
        ValueError: (at setup) a split without a mask field (the message says what it holds).
    """

    target_kind = "mask"
    task = "segmentation"


class DetectionDataModule(_TaskDataModule):
    """Object detection: dict batches with ``image``, ``boxes`` and ``box_labels``.

    Its options are `ShardDataModule`'s, the same typed keywords (its signature, for
    LightningCLI too), but for one default: ``train_transforms=None`` is `detection_preset`
    (whole image resized, flipped half of the time: no crop loses a box); any `ShardDataModule`
    preset works ("photo" crops, and boxes left with no area are dropped with their labels).

    Raises:
        ValueError: (at setup) a split without a boxes field (the message says what it holds).
    """

    target_kind = "boxes"
    task = "detection"

    def _default_train_transforms(self, name: str) -> Preset:
        return detection_preset()
