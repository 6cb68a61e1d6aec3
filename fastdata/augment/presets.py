"""Augmentation presets: typed ops grouped into a `Preset`; user callables wrapped as one op.

A `Preset` says by its typed fields what a backend may fuse, so no backend looks at names:

- `Preset.decode_crop(train)`: a leading `RandomResizedCrop` (optionally followed by a `Flip`) or
  `ResizeCenterCrop` that a decoder can apply while decoding (the cpu backend's Pillow geometry,
  DALI's fused decode-and-crop, the nvjpeg backend's crop after decoding);
- `Preset.pad_crop(train)`: the memory backend's fused pad-crop (train ops exactly one `PadCrop`).

A backend reports how many leading ops it applied (`BatchLoader.applied_ops`) and whether it also
normalized; `Preset.apply(..., skip=n)` runs the rest on the device. Semantics of the built-in
presets are in the `fastdata.augment` package docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import Tensor

from fastdata._util.pool import TensorPool
from fastdata.augment.constants import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD
from fastdata.augment.kernels import (
    normalize,
    random_crop_with_padding,
    random_flip,
    resize_center_crop,
    resized_crop,
)
from fastdata.augment.params import batch_rrc_params

__all__ = [
    "DEFAULT_PHOTO_SIZE",
    "PRESETS",
    "SMALL_IMAGE_SIDE",
    "BatchTransform",
    "Flip",
    "Op",
    "PadCrop",
    "default_preset",
    "Preset",
    "RandomResizedCrop",
    "ResizeCenterCrop",
    "get_preset",
    "image_seed",
]


@dataclass(frozen=True)
class PadCrop:
    """Random crop of the input size from the input zero-padded by `pad` (RandomCrop(padding=)),
    then a horizontal flip with probability `flip_p` (fused into the crop's gather)."""

    pad: int = 4
    flip_p: float = 0.5

    def __call__(self, x: Tensor, size: int | None, generator: torch.Generator | None) -> Tensor:
        return random_crop_with_padding(x, self.pad, generator, self.flip_p)


@dataclass(frozen=True)
class Flip:
    """Horizontal flip of each image with probability `p`."""

    p: float = 0.5

    def __call__(self, x: Tensor, size: int | None, generator: torch.Generator | None) -> Tensor:
        return random_flip(x, generator, self.p)


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision RandomResizedCrop to the preset's `image_size` (antialiased bilinear)."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    antialias: bool = True
    needs_size = True

    def __call__(self, x: Tensor, size: int | None, generator: torch.Generator | None) -> Tensor:
        n, _, h, w = x.shape
        boxes = batch_rrc_params((n, h, w), self.scale, self.ratio, generator, device=x.device)
        return resized_crop(x, boxes, size, self.antialias)


@dataclass(frozen=True)
class ResizeCenterCrop:
    """Shorter side resized to ``floor(image_size * ratio)``, then the centre `image_size` crop."""

    ratio: float = 256 / 224
    antialias: bool = True
    needs_size = True

    def __call__(self, x: Tensor, size: int | None, generator: torch.Generator | None) -> Tensor:
        return resize_center_crop(x, size, self.ratio, self.antialias)


@dataclass(frozen=True)
class BatchTransform:
    """A user's callable on uint8 (N, 3, H, W) images on the device, returning (N, 3, H', W') on
    the 0..255 scale (uint8 or float): a `torchvision.transforms.v2` pipeline, a kornia
    augmentation, or plain torch.

    With `per_sample` (the default) the callable is called once per image, on a (1, 3, H, W)
    slice, with torch's global generator seeded for that image from the batch's seed and the
    image's index (`image_seed`): every image gets its own random draws (a v2 transform called
    on a whole batch draws once for all of it), and a resumed run repeats them. With
    ``per_sample=False`` it is called once on the whole batch, seeded with the batch's seed: for
    callables that already draw per image (e.g. kornia's, or the transforms guide's
    ``jitter_and_erase``), which then run without the per-image loop.

    Args:
        fn: the callable.
        per_sample: call it once per image (True) or once per batch (False).
    """

    fn: Callable[[Tensor], Tensor]
    per_sample: bool = True

    def __call__(self, x: Tensor, size: int | None, generator: torch.Generator | None) -> Tensor:
        if generator is None and not self.per_sample:
            return self.fn(x)
        devices = [x.device] if x.device.type == "cuda" else []
        if generator is not None:
            seed = generator.initial_seed()
        else:  # unseeded: a fresh base seed from torch's generator
            seed = int(torch.randint(0, 2**62, (1,)))
        with torch.random.fork_rng(devices=devices):
            if not self.per_sample:
                _seed_global(seed, x.device)
                return self.fn(x)
            outs = []
            for i in range(x.shape[0]):
                _seed_global(image_seed(seed, i), x.device)
                outs.append(self.fn(x[i : i + 1]))
        return _stack(outs, self.fn, x)

    @property
    def name(self) -> str:
        """The callable's name (for messages)."""
        return getattr(self.fn, "__name__", type(self.fn).__name__)


def _seed_global(seed: int, device: torch.device) -> None:
    """Seed torch's global CPU generator and, for a CUDA batch, its device's generator (what
    `torch.manual_seed` does for them, without its ~0.3 ms of seeding every other backend)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


def image_seed(batch_seed: int, index: int) -> int:
    """The seed of image `index` of a batch (splitmix64 of the pair; < 2**63)."""
    z = (batch_seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _stack(outs: list[Tensor], fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """The per-image results as one batch (ValueError naming the callable when they differ)."""
    if not outs:
        return x
    outs = [o if o.dim() == 4 else o.unsqueeze(0) for o in outs]  # a v2 transform may squeeze
    shapes = {tuple(o.shape[1:]) for o in outs}
    if len(shapes) > 1 or outs[0].shape[0] != 1:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"transform {name!r} called per image on (1, C, H, W) slices returned shapes "
            f"{sorted(shapes)}: it must return one (1, C, H', W') image of the same size for "
            "every image (crop or resize to a fixed size), or be wrapped as "
            "fastdata.augment.BatchTransform(fn, per_sample=False) if it works on whole batches"
        )
    return torch.cat(outs)


Op = Union[PadCrop, Flip, RandomResizedCrop, ResizeCenterCrop, BatchTransform]  # noqa: UP007
_SIZED = (RandomResizedCrop, ResizeCenterCrop)
DecodeCrop = Union[RandomResizedCrop, ResizeCenterCrop]  # noqa: UP007


@dataclass(frozen=True)
class Preset:
    """An augmentation recipe: ops for train and eval, then normalization.

    Args:
        name: preset name (for messages only; no backend reads it).
        image_size: output side; ops that resize need it; when set, `apply` checks the output is
            ``image_size`` squared. None keeps the input size.
        mean: per-channel mean, 0..255 scale.
        std: per-channel std, 0..255 scale.
        train_ops: ops applied in order when ``train=True``.
        eval_ops: ops applied in order when ``train=False``.
        dtype: dtype of `apply`'s result.
        channels_last: return `apply`'s result in the channels-last memory format.
    """

    name: str
    image_size: int | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_ops: tuple[Op, ...] = ()
    eval_ops: tuple[Op, ...] = ()
    dtype: torch.dtype = field(default=torch.float32)
    channels_last: bool = False

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise ValueError(
                f"preset {self.name!r}: need positive std per mean, got {self.mean}, {self.std}"
            )
        for op in self.train_ops + self.eval_ops:
            if not callable(op):
                raise ValueError(f"preset {self.name!r}: op {op!r} is not callable")
            if isinstance(op, _SIZED) and self.image_size is None:
                raise ValueError(f"preset {self.name!r}: op {op!r} needs image_size")

    def ops(self, train: bool) -> tuple[Op, ...]:
        """The ops of a training or an evaluation batch."""
        return self.train_ops if train else self.eval_ops

    def decode_crop(self, train: bool) -> tuple[DecodeCrop | None, float, int]:
        """What a decoder may fuse: (leading crop op or None, flip probability, ops it covers)."""
        ops = self.ops(train)
        if not ops or not isinstance(ops[0], _SIZED):
            return None, 0.0, 0
        if len(ops) > 1 and isinstance(ops[0], RandomResizedCrop) and isinstance(ops[1], Flip):
            return ops[0], ops[1].p, 2
        return ops[0], 0.0, 1

    def resizes(self, train: bool) -> bool:
        """Whether the split's ops crop to `image_size` themselves (`RandomResizedCrop`,
        `ResizeCenterCrop`): then images are decoded with room around that size
        (`fastdata.read.decoders.image.stored_hw`); otherwise straight at the output size."""
        return any(isinstance(op, _SIZED) for op in self.ops(train))

    def pad_crop(self, train: bool) -> PadCrop | None:
        """The pad-crop the memory backend fuses with normalization, when the ops are just that."""
        ops = self.ops(train)
        return ops[0] if len(ops) == 1 and isinstance(ops[0], PadCrop) else None

    def with_stats(self, mean: Sequence[float], std: Sequence[float]) -> Preset:
        """This preset normalizing with other statistics (0..255 scale)."""
        from dataclasses import replace

        return replace(self, mean=tuple(map(float, mean)), std=tuple(map(float, std)))

    def apply(
        self,
        x: Tensor,
        train: bool,
        generator: torch.Generator | None = None,
        pool: TensorPool | None = None,
        skip: int = 0,
    ) -> Tensor:
        """Augment (train) or just prepare (eval) a uint8 ``(N, C, H, W)`` batch on its device.

        Clips ``(N, T, C, H, W)`` get one draw per clip (frames folded into channels: every
        built-in op moves a row's channels alike), then each frame is normalized: ``(N, T, C, S, S)``.

        Args:
            x: uint8 batch (or clips), contiguous or channels-last (float 0..255 also works).
            train: use `train_ops` (True) or `eval_ops` (False).
            generator: torch generator for reproducible random draws (CPU or the batch's device).
            pool: reuse the memory of earlier results nobody holds any more (CPU batches).
            skip: leading ops already applied by the loader (fused at decode time).

        Returns:
            Normalized ``(N, C, S, S)`` tensor of `dtype` on x's device.
        """
        if x.dim() == 5:
            return self._apply_clips(x, train, generator, pool, skip)
        if x.dim() != 4 or x.shape[1] != len(self.mean):
            raise ValueError(
                f"preset {self.name!r} expects an (N, {len(self.mean)}, H, W) batch, "
                f"got shape {tuple(x.shape)}"
            )
        ops, in_hw = self.ops(train), tuple(x.shape[-2:])
        for op in ops[skip:]:
            x = op(x, self.image_size, generator)
        size = self.image_size
        custom = any(isinstance(op, BatchTransform) for op in ops)  # the user's size is theirs
        if size is not None and not custom and tuple(x.shape[-2:]) != (size, size):
            names = ", ".join(type(op).__name__ for op in ops[skip:]) or "none"
            raise ValueError(
                f"preset {self.name!r} has image_size={size} but its "
                f"{'train' if train else 'eval'} ops [{names}] turned the loader's "
                f"{in_hw[0]}x{in_hw[1]} batch into {x.shape[-2]}x{x.shape[-1]} images; end the ops with one that crops or resizes to "
                "image_size (RandomResizedCrop, ResizeCenterCrop), or use image_size=None"
            )
        out = None
        if pool is not None:
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            out = pool.empty(tuple(x.shape), self.dtype, x.device, fmt)
        return normalize(x, self.mean, self.std, self.dtype, self.channels_last, out)

    def _apply_clips(
        self,
        x: Tensor,
        train: bool,
        generator: torch.Generator | None,
        pool: TensorPool | None,
        skip: int,
    ) -> Tensor:
        """`apply` on clips ``(N, T, C, H, W)``: one draw per clip, the same for its frames."""
        n, t, c, h, w = x.shape
        ops = self.ops(train)[skip:]
        if c != len(self.mean) or any(isinstance(op, BatchTransform) for op in ops):
            raise ValueError(
                f"preset {self.name!r} expects clips (N, T, {len(self.mean)}, H, W) and built-in "
                f"ops only (a callable sees single images), got shape {tuple(x.shape)}"
            )
        folded = x.reshape(n, t * c, h, w)
        for op in ops:
            folded = op(folded, self.image_size, generator)
        s_h, s_w = folded.shape[-2:]
        frames = self.apply(
            folded.reshape(n * t, c, s_h, s_w), train, None, pool, skip=len(ops) + skip
        )
        return frames.reshape(n, t, c, s_h, s_w)


#: Output side of photos (images of varying size) when no ``image_size`` is given.
DEFAULT_PHOTO_SIZE = 224
#: Fixed-size images at most this many pixels a side get the "cifar" preset by default.
SMALL_IMAGE_SIDE = 64


def default_preset(
    raw_shape: Sequence[int] | None, image_size: int | None = None
) -> tuple[str, int | None]:
    """(preset name, output side) for a training split when neither is given: the one rule that
    `ShardDataModule`, its `image_shape` and `fastdata.tune.tuning_spec` follow.

    Fixed-size images (`raw_shape`, (H, W, C)) at most `SMALL_IMAGE_SIDE` a side get "cifar",
    anything else "photo". Images of varying size (`raw_shape` None) must be cropped to one
    size: `DEFAULT_PHOTO_SIZE` unless `image_size` is given; fixed-size data keeps `image_size`
    (None: its own size).
    """
    if image_size is None and raw_shape is None:
        image_size = DEFAULT_PHOTO_SIZE
    small = raw_shape is not None and max(raw_shape[:2]) <= SMALL_IMAGE_SIDE
    return ("cifar" if small else "photo"), image_size


def _stats(given: Sequence[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    return default if given is None else tuple(float(v) for v in given)


_Stats = Sequence[float] | None


def _cifar(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    mean, std = _stats(mean, CIFAR100_MEAN), _stats(std, CIFAR100_STD)
    return Preset("cifar", image_size, mean, std, (PadCrop(pad=4, flip_p=0.5),))


def _photo(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    mean, std = _stats(mean, IMAGENET_MEAN), _stats(std, IMAGENET_STD)
    train = (RandomResizedCrop(), Flip(0.5))
    return Preset(
        "photo", image_size or DEFAULT_PHOTO_SIZE, mean, std, train, (ResizeCenterCrop(),)
    )


def _none(image_size: int | None = None, mean: _Stats = None, std: _Stats = None) -> Preset:
    return Preset("none", image_size, _stats(mean, (0.0,) * 3), _stats(std, (255.0,) * 3))


#: Preset name -> factory ``(image_size=None, mean=None, std=None) -> Preset``.
PRESETS: dict[str, Callable[..., Preset]] = {
    "cifar": _cifar,
    "photo": _photo,
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
        image_size: output side; None keeps the preset's default (224 for "photo", the input
            size otherwise).
        mean: per-channel mean on the 0..255 scale; None keeps the preset's.
        std: per-channel std on the 0..255 scale; None keeps the preset's.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown augmentation preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](image_size=image_size, mean=mean, std=std)
