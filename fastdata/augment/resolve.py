"""What users pass as transforms (a name, a `Preset`, a callable) -> the one `Preset` a run uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Union

from torch import Tensor

from fastdata.augment.presets import BatchTransform, Preset, get_preset

__all__ = ["TransformSpec", "resolve_transforms"]

#: A preset name ("cifar", "photo", "none"), a `Preset`, or a callable on uint8 NCHW batches.
TransformSpec = Union[str, Preset, Callable[[Tensor], Tensor]]  # noqa: UP007


def _as_preset(spec: TransformSpec, image_size: int | None) -> tuple[Preset, bool]:
    """(preset, True when it came from a user callable)."""
    if isinstance(spec, Preset):
        return spec, False
    if isinstance(spec, str):
        return get_preset(spec, image_size), False
    if callable(spec):
        op = BatchTransform(spec)
        return Preset(
            getattr(spec, "__name__", "custom"), None, (0.0,) * 3, (255.0,) * 3, (op,), (op,)
        ), True
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

    A user callable's output size is not checked against `image_size` (the preset's size check
    applies to built-in ops only).
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
