"""Augmentation presets: `Op` steps from the `OPS` registry, grouped into a `Preset`.

The semantics of every preset are described in the `fastdata.augment` package docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastdata._pool import TensorPool
from fastdata.augment.constants import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD
from fastdata.augment.kernels import (
    normalize,
    random_crop_with_padding,
    random_flip,
    resize_center_crop,
    resized_crop,
)
from fastdata.augment.params import batch_rrc_params

__all__ = ["OPS", "PRESETS", "Op", "Preset", "get_preset"]


@dataclass(frozen=True)
class Op:
    """One augmentation step of a preset: a name in `OPS` and its keyword arguments.

    Args:
        name: key of `OPS`.
        params: ``(keyword, value)`` pairs (a tuple so that the preset stays hashable).
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **params: Any) -> Op:
        """``Op.of("flip", p=0.5)``."""
        return cls(name, tuple(sorted(params.items())))


def _op_pad_crop(
    x: Tensor,
    size: int | None,
    generator: torch.Generator | None,
    pad: int = 4,
    flip_p: float = 0.0,
) -> Tensor:
    return random_crop_with_padding(x, pad, generator, flip_p)


def _op_flip(
    x: Tensor, size: int | None, generator: torch.Generator | None, p: float = 0.5
) -> Tensor:
    return random_flip(x, generator, p)


def _op_rrc(
    x: Tensor,
    size: int | None,
    generator: torch.Generator | None,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    antialias: bool = True,
) -> Tensor:
    assert size is not None  # Preset.__post_init__ requires image_size for this op
    n, _, h, w = x.shape
    boxes = batch_rrc_params((n, h, w), scale, ratio, generator, device=x.device)
    return resized_crop(x, boxes, size, antialias)


def _op_resize_center_crop(
    x: Tensor,
    size: int | None,
    generator: torch.Generator | None,
    resize_ratio: float = 256 / 224,
    antialias: bool = True,
) -> Tensor:
    assert size is not None  # Preset.__post_init__ requires image_size for this op
    return resize_center_crop(x, size, resize_ratio, antialias)


OpFn = Callable[..., Tensor]
#: Op name -> ``fn(x, size, generator, **params)``; `size` is the preset's image_size.
OPS: dict[str, OpFn] = {
    "pad_crop": _op_pad_crop,
    "flip": _op_flip,
    "random_resized_crop": _op_rrc,
    "resize_center_crop": _op_resize_center_crop,
}
_SIZED_OPS = frozenset({"random_resized_crop", "resize_center_crop"})


@dataclass(frozen=True)
class Preset:
    """A named augmentation recipe: ops for train and eval, then normalization.

    Args:
        name: preset name (for messages).
        image_size: output side; ops that resize need it; when set, `apply` checks the output is
            ``image_size`` squared. None keeps the input size.
        mean: per-channel mean, 0..255 scale.
        std: per-channel std, 0..255 scale.
        train_ops: ops applied in order when ``train=True``.
        eval_ops: ops applied in order when ``train=False``.
        dtype: dtype of `apply`'s result.
        channels_last: return `apply`'s result in the channels-last memory format.
        decode_flip_p: training flip probability a CPU decoder applies per image while decoding
            (the CPU backend reads it; `apply` does not flip for it). Cheaper there than on a
            CPU device: a batched flip of 64 channels-last 224 px images took 15 ms on the
            training process's core, a PIL transpose ~0.05 ms per image in a loader worker.
    """

    name: str
    image_size: int | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_ops: tuple[Op, ...] = ()
    eval_ops: tuple[Op, ...] = ()
    dtype: torch.dtype = field(default=torch.float32)
    channels_last: bool = False
    decode_flip_p: float = 0.0

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise ValueError(
                f"preset {self.name!r}: need positive std per mean, got {self.mean}, {self.std}"
            )
        for op in self.train_ops + self.eval_ops:
            if op.name not in OPS:
                raise ValueError(
                    f"preset {self.name!r}: unknown op {op.name!r}; known: {sorted(OPS)}"
                )
            if op.name in _SIZED_OPS and self.image_size is None:
                raise ValueError(f"preset {self.name!r}: op {op.name!r} needs image_size")

    def apply(
        self,
        x: Tensor,
        train: bool,
        generator: torch.Generator | None = None,
        pool: TensorPool | None = None,
    ) -> Tensor:
        """Augment (train) or just prepare (eval) a uint8 ``(N, C, H, W)`` batch on its device.

        Args:
            x: uint8 batch, contiguous or channels-last (float on the 0..255 scale also works).
            train: use `train_ops` (True) or `eval_ops` (False).
            generator: torch generator for reproducible random draws (CPU or the batch's device).
            pool: reuse the memory of earlier results nobody holds any more (CPU batches).

        Returns:
            Normalized ``(N, C, S, S)`` tensor of `dtype` on x's device.
        """
        if x.dim() != 4 or x.shape[1] != len(self.mean):
            raise ValueError(
                f"preset {self.name!r} expects an (N, {len(self.mean)}, H, W) batch, "
                f"got shape {tuple(x.shape)}"
            )
        for op in self.train_ops if train else self.eval_ops:
            x = OPS[op.name](x, self.image_size, generator, **dict(op.params))
        size = self.image_size
        if size is not None and tuple(x.shape[-2:]) != (size, size):
            raise ValueError(
                f"preset {self.name!r} expects {size}x{size} images, "
                f"got {x.shape[-2]}x{x.shape[-1]}; "
                "decode at that size, pass the matching image_size, or use 'photo_device' for "
                "full-size images"
            )
        out = None
        if pool is not None:
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            out = pool.empty(tuple(x.shape), self.dtype, x.device, fmt)
        return normalize(x, self.mean, self.std, self.dtype, self.channels_last, out)


def _stats(given: Sequence[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    return default if given is None else tuple(float(v) for v in given)


_FLIP = Op.of("flip", p=0.5)
_Stats = Sequence[float] | None


def _cifar(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    mean, std = _stats(mean, CIFAR100_MEAN), _stats(std, CIFAR100_STD)
    # The flip rides in the crop's gather (one pass instead of two; same draws, same result).
    return Preset("cifar", image_size, mean, std, (Op.of("pad_crop", pad=4, flip_p=0.5),))


def _photo(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    mean, std = _stats(mean, IMAGENET_MEAN), _stats(std, IMAGENET_STD)
    # The CPU decoder crops (random-resized-crop) and flips: the device only normalizes.
    return Preset("photo", image_size or 224, mean, std, decode_flip_p=0.5)


def _photo_device(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    mean, std = _stats(mean, IMAGENET_MEAN), _stats(std, IMAGENET_STD)
    rrc = Op.of("random_resized_crop", scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    centre = Op.of("resize_center_crop", resize_ratio=256 / 224)
    return Preset("photo_device", image_size or 224, mean, std, (rrc, _FLIP), (centre,))


def _none(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    return Preset("none", image_size, _stats(mean, (0.0,) * 3), _stats(std, (255.0,) * 3))


#: Preset name -> factory ``(image_size=None, mean=None, std=None) -> Preset``.
PRESETS: dict[str, Callable[..., Preset]] = {
    "cifar": _cifar,
    "photo": _photo,
    "photo_device": _photo_device,
    "none": _none,
}


def get_preset(
    name: str,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Preset:
    """The preset called `name` (see the `fastdata.augment` docstring), with optional size / stats.

    Args:
        name: a key of `PRESETS`.
        image_size: output side; None keeps the preset's default (224 for the photo presets, the
            input size otherwise).
        mean: per-channel mean on the 0..255 scale; None keeps the preset's.
        std: per-channel std on the 0..255 scale; None keeps the preset's.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown augmentation preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](image_size=image_size, mean=mean, std=std)
