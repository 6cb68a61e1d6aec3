"""Dict batches: a non-classification split's samples decoded field by field and collated.

A split whose fields are not exactly an image and a label (`fastdata.format.fields.is_classification`)
yields dict batches (`TrainSample` / `EvalSample`):

| field kind | batch value                                                              |
|------------|--------------------------------------------------------------------------|
| `image`    | uint8 (N, 3, H, W) (float normalized after `on_after_batch_transfer`)    |
| `mask`     | int64 (N, H, W)                                                          |
| `boxes`    | a list of float32 (k_i, 4) xyxy under the field's name, and a list of    |
|            | int64 (k_i,) under ``box_labels`` (``<name>_labels`` for another name)   |
| `labels`   | multi-hot float32 (N, num_classes)                                       |
| `label`    | int64 (N,)                                                               |
| `text`     | list[str]                                                                |
| `json`     | list                                                                     |
| `array`    | a stacked tensor when every shape agrees, else a list of tensors         |
| `tensors`  | `.ten` arrays: a list of stacked tensors (one per array of a sample)     |
|            | when every sample's shapes agree, else a list of lists of tensors        |

With ``keys=True`` (`LoaderSpec.keys`) a batch also holds ``key``: list[str | None], each
row's sample key (None for padding); the loader adds ``source_id`` (`fastdata.read.source_ids`).

A batch always holds ``padded`` bool (N,): True for evaluation padding (repeats that make every rank's
batches equal): their mask is all `ignore_index`, their boxes empty, their label -100
(`plan.PAD_LABEL`), their multi-hot all zeros, so every metric can skip them.

The cpu backend's workers decode every field (`FieldSpec.decode`), draw each sample's `Region`
from the plan's batch seed (`fastdata.augment.targets.draw_regions`) and warp the image, mask and
boxes together at decode time (`warp_sample`); the memory backend keeps the split's samples
resident at their own size (`fastdata.read.backends.memory_dict`) and warps them with the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdata.augment import BatchTransform, Preset
from fastdata.format.fields import FieldError, FieldSpec, is_classification
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders.image import Geometry, decode_image, decode_raw
from fastdata.read.plan import PAD_LABEL
from fastdata.read.rows import PlannedBatch, RowReader, RowSample, Skip

__all__ = [
    "EvalSample",
    "Sample",
    "SampleSpec",
    "TrainSample",
    "box_labels_key",
    "collate_samples",
    "decode_fields",
    "decode_samples",
    "refuse_fields",
    "sample_spec",
]

_NO_DRAWS = np.random.default_rng(0)  # geometry "none" draws nothing


def _carriers() -> str:
    """The registered backends that carry every field, for messages ("'cpu' or 'memory'")."""
    from fastdata.read import field_backends

    return " or ".join(repr(name) for name in sorted(field_backends()))


def refuse_fields(spec: LoaderSpec, backend: str) -> None:
    """Refuse a non-classification split in a backend that reads images and labels only.

    Raises:
        ValueError: the split holds other fields; the message names the backends that can.
    """
    fields = spec.manifest.split(spec.split).field_specs
    if is_classification(fields):
        return
    held = ", ".join(f"{n} ({f.kind})" for n, f in fields.items())
    raise ValueError(
        f"the {backend} backend reads an image and a label only, but split {spec.split!r} of "
        f"{spec.manifest.root} holds {held}; use backend={_carriers()}, which carry every "
        "field"
    )


class Sample(dict):
    """A dict batch (field name -> batched value); see the module docstring."""

    __slots__ = ()


class TrainSample(Sample):
    """A dict batch yielded by a training loader: augmented and counted as trained on."""

    __slots__ = ()


class EvalSample(Sample):
    """A dict batch yielded by an evaluation loader (val, test, predict)."""

    __slots__ = ()


def box_labels_key(name: str) -> str:
    """The batch key of a boxes field's classes: ``box_labels`` for ``boxes``."""
    return "box_labels" if name == "boxes" else f"{name}_labels"


@dataclass(frozen=True)
class SampleSpec:
    """What decoding a dict dataset's batch needs (picklable: it travels to the workers).

    Args:
        fields: the split's fields (`SplitInfo.field_specs`).
        preset: the augmentation preset (its ops are drawn as `Region`s).
        train: training (the train ops) or evaluation (the eval ops, padding marks).
        out_hw: the output (H, W) of the warped samples; None: no warp (stored size).
        raw_shape: (H, W, C) of raw (`rgb`) images.
        ignore_index: the mask value of pixels outside the image and of padding samples.
        num_classes: width of a `labels` field's multi-hot vector.
        keys: add each row's sample key (``key``; None for padding) to the batch.
    """

    fields: Mapping[str, FieldSpec]
    preset: Preset
    train: bool
    out_hw: tuple[int, int] | None
    raw_shape: tuple[int, int, int] | None = None
    ignore_index: int = 255
    num_classes: int = 0
    keys: bool = False

    @property
    def image(self) -> str | None:
        """The name of the split's image field (the first one), None without one."""
        return next((n for n, f in self.fields.items() if f.kind == "image"), None)


def sample_spec(spec: LoaderSpec, out_hw: tuple[int, int] | None = None) -> SampleSpec | None:
    """The `SampleSpec` of a loader's split; None for a classification split (`(x, y)` batches).

    Args:
        spec: the loader spec.
        out_hw: the output size (default: `image_size` squared, else the stored common size).

    Raises:
        ValueError: images of varying size without image_size, or a preset with a user
            callable (it sees only images; the targets would not follow it).
    """
    info = spec.manifest.split(spec.split)
    fields = info.field_specs
    if is_classification(fields):
        return None
    taken = sorted({"key", "source_id"} & set(fields)) if spec.keys else []
    if taken:
        raise ValueError(
            f"split {spec.split!r} of {spec.manifest.root} has field(s) {taken}, the names "
            "keys=True gives the batch keys; pass keys=False (the samples' own fields stay)"
        )
    ops = spec.preset.ops(spec.train)
    if any(isinstance(op, BatchTransform) for op in ops):
        raise ValueError(
            f"split {spec.split!r} of {spec.manifest.root} holds {sorted(fields)}: a preset with a "
            "user callable moves only the images, not masks or boxes; use a built-in preset "
            "('photo', 'cifar', 'none') or a `Preset` of RandomResizedCrop / PadCrop / Flip / "
            "ResizeCenterCrop ops"
        )
    raw = tuple(info.raw_shape) if info.raw_shape else None
    if out_hw is None:
        if spec.image_size is not None:
            out_hw = (spec.image_size, spec.image_size)
        elif raw is not None:
            out_hw = (int(raw[0]), int(raw[1]))
        else:
            raise ValueError(
                f"split {spec.split!r} of {spec.manifest.root}: its images vary in size "
                f"({info.image_stats or 'no stats'}); pass image_size to warp them to one size"
            )
    return SampleSpec(
        fields=dict(fields),
        preset=spec.preset,
        train=spec.train,
        out_hw=out_hw,
        raw_shape=raw if info.encoding == "raw" else None,
        ignore_index=spec.ignore_index,
        num_classes=spec.manifest.num_classes,
        keys=spec.keys,
    )


def _check_classes(classes: np.ndarray, num_classes: int, kind: str) -> None:
    """Raise FieldError when a class index is outside the manifest's classes (a tampered or
    foreign shard: a negative index would otherwise wrap to the last class)."""
    if classes.size and (classes.min() < 0 or classes.max() >= num_classes):
        raise FieldError(
            f"{kind}: class indices {classes.reshape(-1).tolist()[:8]} outside the manifest's "
            f"{num_classes} classes; run `fastdata verify` on the dataset"
        )


def decode_fields(rows: RowReader, sample: RowSample, spec: SampleSpec) -> dict[str, Any] | Skip:
    """Every field of one read sample (the image as HWC uint8), or its `Skip` (on_error='skip').

    Raises:
        ShardReadError: a field cannot be decoded and on_error is "raise" (names shard, key and
            field).
    """
    values: dict[str, Any] = {}
    for name, field in spec.fields.items():
        try:
            value = field.decode(sample.parts)
            if field.kind == "image":
                value = _decode_image(value, field, sample, spec)
            elif field.kind == "label":
                value = rows.reader.shards[sample.shard].map_label(value)
                _check_classes(np.asarray([value]), spec.num_classes, "label")
            elif field.kind in ("labels", "boxes"):
                value = _map_classes(value, field.kind, rows.reader.shards[sample.shard])
                classes = value if field.kind == "labels" else value[1]
                _check_classes(np.asarray(classes), spec.num_classes, field.kind)
            values[name] = value
        except (FieldError, ValueError) as exc:
            return rows.fail(sample.shard, sample.index, exc, field=name)
    image = values.get(spec.image) if spec.image else None
    for name, field in spec.fields.items():
        if field.kind == "mask" and image is not None:
            if values[name].shape != image.shape[:2]:
                exc = FieldError(
                    f"mask is {values[name].shape[0]}x{values[name].shape[1]}, its image "
                    f"{image.shape[0]}x{image.shape[1]}: a mask must have its image's size"
                )
                return rows.fail(sample.shard, sample.index, exc, field=name)
    return values


def _map_classes(value: Any, kind: str, entry: Any) -> Any:
    """Class indices of a `labels` or `boxes` field in a mix's merged classes (`map_label`)."""
    if entry.label_map is None:
        return value
    table = np.asarray(entry.label_map, dtype=np.int64)
    classes = value if kind == "labels" else value[1]
    if len(classes) and (classes.min() < 0 or classes.max() >= len(table)):
        raise FieldError(
            f"class indices {classes.tolist()[:8]} outside the dataset's {len(table)} classes"
        )
    mapped = table[classes]
    return mapped if kind == "labels" else (value[0], mapped)


def _decode_image(
    data: memoryview | bytes, field: FieldSpec, sample: RowSample, spec: SampleSpec
) -> np.ndarray:
    if "rgb" in sample.parts and "rgb" in field.components:
        if spec.raw_shape is None:
            raise FieldError("rgb sample in a split without raw_shape; re-run `fastdata shard`")
        pixels = decode_raw(data, spec.raw_shape)
    else:
        pixels = decode_image(data, Geometry("none"), _NO_DRAWS)
    return pixels if pixels.flags.writeable else pixels.copy()  # not a view of the shard


def warp_fields(values: dict[str, Any], spec: SampleSpec, region: Any) -> dict[str, Any]:
    """One sample's image, masks and boxes moved by its `Region` (`targets.warp_sample`)."""
    from fastdata.augment.targets import warp_sample

    out = dict(values)
    image_name = spec.image
    masks = [n for n, f in spec.fields.items() if f.kind == "mask"]
    boxes = [n for n, f in spec.fields.items() if f.kind == "boxes"]
    image = values[image_name]
    # The first mask and boxes field move with the image in one call; any further one in its own.
    extra = {}
    if masks:
        extra["mask"] = _int64(values[masks[0]])
    if boxes:
        b, bl = values[boxes[0]]
        extra["boxes"], extra["box_labels"] = torch.from_numpy(b), torch.from_numpy(bl)
    warped = warp_sample(image, region, ignore_index=spec.ignore_index, **extra)
    out[image_name] = warped["image"]
    if masks:
        out[masks[0]] = warped["mask"]
    if boxes:
        out[boxes[0]] = (warped["boxes"], warped["box_labels"])
    for name in masks[1:]:
        m = _int64(values[name])
        out[name] = warp_sample(image, region, mask=m, ignore_index=spec.ignore_index)["mask"]
    for name in boxes[1:]:
        b, bl = values[name]
        w = warp_sample(image, region, boxes=torch.from_numpy(b), box_labels=torch.from_numpy(bl))
        out[name] = (w["boxes"], w["box_labels"])
    return out


def decode_samples(
    rows: RowReader,
    batch: PlannedBatch,
    spec: SampleSpec,
    *,
    batch_seed: int,
    skips: list[Skip],
) -> Sample:
    """A planned batch as a dict batch: fields decoded, regions drawn and applied, collated.

    Samples that fail are added to `skips` (on_error='skip') or raise (names shard, key, field).
    """
    decoded, padded, keys = [], [], []
    for sample in batch.samples:
        values = decode_fields(rows, sample, spec)
        if isinstance(values, Skip):
            skips.append(values)
            continue
        decoded.append(values)
        padded.append(sample.padded)
        if spec.keys:
            keys.append(None if sample.padded else rows.reader.key(sample.shard, sample.index))
    if spec.out_hw is not None and spec.image is not None and decoded:
        from fastdata.augment.targets import draw_regions

        sizes = [tuple(v[spec.image].shape[:2]) for v in decoded]
        regions = draw_regions(spec.preset, spec.train, sizes, spec.out_hw, batch_seed)
        decoded = [warp_fields(v, spec, r) for v, r in zip(decoded, regions, strict=True)]
    return collate_samples(decoded, padded, spec, keys if spec.keys else None)


def collate_samples(
    samples: list[dict[str, Any]],
    padded: list[bool],
    spec: SampleSpec,
    keys: list[str | None] | None = None,
) -> Sample:
    """One dict batch from decoded samples (see the module docstring), padding marked;
    `keys` (one per sample, None for padding) become its ``key`` entry when given."""
    n = len(samples)
    pad = torch.tensor(padded, dtype=torch.bool) if n else torch.zeros(0, dtype=torch.bool)
    out = Sample()
    for name, field in spec.fields.items():
        values = [s[name] for s in samples]
        if field.kind == "image":
            out[name] = _stack_images(values, spec)
        elif field.kind == "mask":
            out[name] = _stack_masks(values, spec, pad)
        elif field.kind == "boxes":
            boxes = [torch.as_tensor(b, dtype=torch.float32).reshape(-1, 4) for b, _ in values]
            labels = [torch.as_tensor(c, dtype=torch.int64).reshape(-1) for _, c in values]
            for i in np.flatnonzero(padded).tolist():
                boxes[i], labels[i] = boxes[i][:0], labels[i][:0]
            out[name], out[box_labels_key(name)] = boxes, labels
        elif field.kind == "labels":
            hot = torch.zeros((n, spec.num_classes), dtype=torch.float32)
            for i, v in enumerate(values):
                if not padded[i]:
                    hot[i, torch.as_tensor(v, dtype=torch.int64)] = 1.0
            out[name] = hot
        elif field.kind == "label":
            y = torch.tensor([int(v) for v in values], dtype=torch.int64)
            out[name] = y.masked_fill(pad, PAD_LABEL) if n else y
        elif field.kind == "array":
            arrays = [torch.as_tensor(np.array(v)) for v in values]
            same = arrays and all(
                a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays
            )
            out[name] = torch.stack(arrays) if same else arrays
        elif field.kind == "tensors":
            out[name] = _collate_tensors(values)
        else:  # text, json
            out[name] = values
    out["padded"] = pad
    if keys is not None:
        out["key"] = list(keys)
    return out


def _collate_tensors(values: list[list[np.ndarray]]) -> list[Any]:
    """A `tensors` field: one stacked tensor per position when every sample holds arrays of
    the same shapes and dtypes, else each sample's list of tensors."""
    rows = [[torch.as_tensor(np.array(a)) for a in v] for v in values]
    first = rows[0] if rows else []
    same = all(
        len(r) == len(first)
        and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(r, first, strict=True))
        for r in rows
    )
    return [torch.stack(col) for col in zip(*rows, strict=True)] if rows and same else rows


def _stack_images(values: list[Any], spec: SampleSpec) -> torch.Tensor:
    if not values:
        h, w = spec.out_hw or (spec.raw_shape[:2] if spec.raw_shape else (0, 0))
        return torch.zeros((0, 3, h, w), dtype=torch.uint8)
    chw = [
        v
        if isinstance(v, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(v)).permute(2, 0, 1)
        for v in values
    ]
    return torch.stack(chw).to(torch.uint8).contiguous()


def _stack_masks(values: list[Any], spec: SampleSpec, pad: torch.Tensor) -> torch.Tensor:
    if not values:
        h, w = spec.out_hw or (0, 0)
        return torch.zeros((0, h, w), dtype=torch.int64)
    masks = torch.stack([_int64(v) for v in values])
    if pad.any():
        masks[pad] = spec.ignore_index
    return masks


def _int64(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.int64)
    return torch.from_numpy(np.asarray(value).astype(np.int64))
