"""What users pass as transforms (a name, a `Preset`, a callable) -> the one `Preset` a run uses."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Union

from torch import Tensor

from fastdata.augment.presets import BatchTransform, Preset, get_preset
from fastdata.format.manifest import SplitInfo

__all__ = ["TransformSpec", "check_sizes", "resolve_transforms"]

#: A preset name ("cifar", "photo", "none"), a `Preset`, or a callable on uint8 NCHW batches.
TransformSpec = Union[str, Preset, Callable[[Tensor], Tensor]]  # noqa: UP007


def _as_preset(spec: TransformSpec, image_size: int | None) -> tuple[Preset, bool]:
    """(preset, True when it came from a user callable)."""
    if isinstance(spec, Preset):
        return spec, False
    if isinstance(spec, str):
        return get_preset(spec, image_size), False
    if callable(spec):
        op = spec if isinstance(spec, BatchTransform) else BatchTransform(spec)
        return Preset(op.name, None, (0.0,) * 3, (255.0,) * 3, (op,), (op,)), True
    raise ValueError(
        f"transforms must be a preset name, a fastdata.augment.Preset or a callable on uint8 "
        f"(N, 3, H, W) batches, got {type(spec).__name__}"
    )


def resolve_transforms(
    train: TransformSpec,
    eval: TransformSpec | None,
    image_size: int | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
) -> Preset:
    """One `Preset`: train ops from `train`, eval ops from `eval` (default: `train`'s own eval ops;
    none for a callable), normalized with `mean`/`std` when given, else the train preset's.

    A callable is run once per image (`BatchTransform`; pass ``BatchTransform(fn,
    per_sample=False)`` for one call per batch). It receives images at the output size
    (``image_size`` squared, or the data's own size), and its output size is not checked (the
    preset's size check applies to built-in ops only). A callable's eval ops, when `eval` is
    None, are none: evaluation images are just normalized, at the output size.
    """
    train_preset, train_custom = _as_preset(train, image_size)
    eval_ops = train_preset.eval_ops if not train_custom else ()
    if eval is not None:
        eval_preset, _ = _as_preset(eval, image_size)
        eval_ops = eval_preset.eval_ops
    preset = replace(
        train_preset,
        name=train_preset.name if eval is None else f"{train_preset.name}/{eval_preset.name}",
        image_size=train_preset.image_size or image_size,
        train_ops=train_preset.train_ops,
        eval_ops=eval_ops,
    )
    if mean is not None or std is not None:
        preset = preset.with_stats(mean or preset.mean, std or preset.std)
    return preset


def check_sizes(preset: Preset, splits: Mapping[str, SplitInfo], image_size: int | None) -> None:
    """Refuse, before any batch, a preset whose output size its ops cannot reach.

    Encoded images are decoded at the output size (`fastdata.read.decoders.image.stored_hw`), but raw
    samples keep theirs: a preset with an `image_size` whose ops for a split do not crop to it
    (no `RandomResizedCrop` / `ResizeCenterCrop`) cannot turn them into ``image_size`` squared
    images, and a user callable would not get the output size it is promised.

    Args:
        preset: the resolved preset.
        splits: split role ("train", "val", "test") -> its split (train ops for "train", eval
            ops for the others).
        image_size: the DataModule's `image_size`.

    Raises:
        ValueError: naming the split, the sizes and what to pass instead.
    """
    from fastdata.read.decoders.image import stored_hw

    size = preset.image_size
    for role, info in splits.items():
        train = role == "train"
        ops = preset.ops(train)
        if size is None or preset.resizes(train):
            continue
        h, w = stored_hw(info, image_size, margin=False)
        if (h, w) != (size, size):
            names = ", ".join(type(op).__name__ for op in ops) or "none"
            raise ValueError(
                f"the {role} split holds {info.encoding} images of {h}x{w}, which are not "
                f"resized, and the {preset.name!r} {'train' if train else 'eval'} ops [{names}] "
                f"do not crop to image_size={size}: pass image_size=None (keep the data's "
                "size; a Preset's own image_size too), transforms that crop to it ('photo'), or "
                "re-shard with `fastdata shard --encoding png` (encoded images are resized to "
                "image_size while decoding)"
            )
