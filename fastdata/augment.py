"""Batched augmentation and normalization on the device (torch only), and the presets.

Every kernel takes a whole uint8 (or 0..255 float) batch ``(N, C, H, W)`` and works the same on CPU
and CUDA tensors: no per-sample Python loop, no host sync on the hot path (airbench style: the batch
is augmented where it already lives). Random parameters are drawn apart from the kernels that apply
them (torchvision v2 style), on the device of the ``torch.Generator`` when one is given (else on the
batch's device) and then moved to the batch: a CPU generator with a fixed seed gives the same
augmentation for a CPU batch and for a CUDA batch.

Presets (`get_preset(name)`); other backends (DALI) must match these semantics:

- ``"cifar"``: train = random 32x32 crop (the input size) of the input zero-padded by 4 pixels on
  every side, offsets ``(dy, dx)`` uniform in ``[0, 8]`` each (torchvision
  ``RandomCrop(32, padding=4)``, zero fill), then horizontal flip with p = 0.5 (fused into the
  crop's gather), then normalize with the CIFAR-100 mean/std. Eval = normalize only.
- ``"photo"``: the CPU decoder already did the geometry (train: random-resized-crop with
  `rrc_params`, scale (0.08, 1), ratio (3/4, 4/3), to ``image_size`` squared; eval: shorter side
  resized to ``floor(image_size * 256 / 224)`` then centre crop, see `center_crop_params`). On the
  device: train = horizontal flip p = 0.5 + normalize (ImageNet mean/std); eval = normalize.
- ``"photo_device"``: for backends that hand over full-size, fixed-size images (the device-resident
  backend): train = random-resized-crop on the device (`batch_rrc_params` + `resized_crop`) + flip +
  normalize; eval = `resize_center_crop` + normalize.
- ``"none"``: normalize to float in [0, 1] (mean 0, std 255).

Resizing is bilinear with antialiasing when shrinking (the filter of PIL and of torchvision /
``F.interpolate(..., antialias=True)``), computed as two batched matrix products with per-sample
weights, so each sample is cropped to its own box and resized exactly as "crop, then resize" would.
Resized pixels stay float (0..255 scale, not rounded back to uint8). Normalization is
``(x - mean) / std`` per channel with mean and std on the 0..255 scale; `Preset.apply` returns
float32 (by default) with the NCHW shape, on the input's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "OPS",
    "PRESETS",
    "Op",
    "Preset",
    "batch_rrc_params",
    "center_crop_params",
    "crop_with_padding",
    "flip_horizontal",
    "get_preset",
    "normalize",
    "random_crop_with_padding",
    "random_flip",
    "resize_center_crop",
    "resized_crop",
    "rrc_params",
]

# ----------------------------------------------------------------------------- constants
# Per-channel mean / std of the training split on the 0..255 scale (RGB). CIFAR-100 values were
# recomputed from the real training set (50,000 images, population std over all pixels).
IMAGENET_MEAN = (123.675, 116.28, 103.53)  # (0.485, 0.456, 0.406) * 255
IMAGENET_STD = (58.395, 57.12, 57.375)  # (0.229, 0.224, 0.225) * 255
CIFAR10_MEAN = (125.3069, 122.9504, 113.8654)
CIFAR10_STD = (62.9932, 62.0887, 66.7049)
CIFAR100_MEAN = (129.3042, 124.0700, 112.4341)
CIFAR100_STD = (68.1702, 65.3918, 70.4184)

_Size = int | tuple[int, int]
# torchvision RandomResizedCrop.get_params tries this many boxes before its centre fallback.
_RRC_TRIES = 10


# ----------------------------------------------------------------------------- random draws
def _rand(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Uniform [0, 1) float64 numbers drawn on the generator's device, returned on `device`."""
    source = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=source, dtype=torch.float64)
    # Asynchronous only towards an accelerator: a non-blocking copy to the CPU lands in pinned
    # memory that CPU ops could read before the copy finished.
    return u.to(device, non_blocking=device.type != "cpu")


def rrc_params(
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    rng: np.random.Generator | None = None,
) -> tuple[int, int, int, int]:
    """Random-resized-crop box of one image, torchvision ``RandomResizedCrop.get_params`` semantics.

    Up to 10 tries: area ``A = height * width * U(scale)``, aspect ``r = exp(U(log ratio))``,
    ``w = round(sqrt(A * r))``, ``h = round(sqrt(A / r))`` (Python rounding); the first box
    that fits is placed at a uniform offset. If none fits: the centred box of the whole image,
    clamped to the ratio range. Random calls per try: ``rng.uniform(*scale)``, then
    ``rng.uniform(log r0, log r1)``; for the chosen box ``rng.integers(0, height - h + 1)``, then
    ``rng.integers(0, width - w + 1)``.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        scale: range of the crop's area as a fraction of the image area.
        ratio: range of the crop's width / height.
        rng: numpy generator; None draws from a fresh, unseeded one (not reproducible).

    Returns:
        ``(top, left, h, w)`` of a box inside the image.
    """
    _check_ranges(scale, ratio)
    rng = rng if rng is not None else np.random.default_rng()
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(_RRC_TRIES):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def batch_rrc_params(
    sizes: Tensor | tuple[int, int, int],
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Vectorized `rrc_params` for a batch: same algorithm and distribution, torch random stream.

    All 10 tries of every sample are drawn at once; each sample keeps its first try that fits, else
    the same centre fallback as `rrc_params`.

    Args:
        sizes: ``(N, 2)`` integer tensor of per-sample ``(height, width)``, or ``(N, H, W)`` for a
            batch of equal-size images.
        scale: range of the crop's area as a fraction of the image area.
        ratio: range of the crop's width / height.
        generator: torch generator (reproducible draws); None uses the default generator.
        device: device of the result; default the device of `sizes` (CPU for a tuple).

    Returns:
        int64 ``(N, 4)`` tensor of ``(top, left, h, w)`` boxes.
    """
    _check_ranges(scale, ratio)
    if isinstance(sizes, Tensor):
        out_device = torch.device(device) if device is not None else sizes.device
        hw = sizes.to(out_device, torch.float64)
    else:
        out_device = torch.device(device) if device is not None else torch.device("cpu")
        n, height, width = sizes
        hw = torch.tensor([[height, width]], dtype=torch.float64, device=out_device).expand(n, 2)
    found, h_box, w_box = _first_fit(hw, scale, ratio, generator)
    height, width = hw[:, 0], hw[:, 1]
    in_ratio = width / height
    # The centre fallback of rrc_params, computed for every sample and kept where no try fits.
    h_box = torch.where(
        found, h_box, torch.where(in_ratio < min(ratio), torch.round(width / min(ratio)), height)
    )
    w_box = torch.where(
        found, w_box, torch.where(in_ratio > max(ratio), torch.round(height * max(ratio)), width)
    )
    u = _rand((hw.shape[0], 2), generator, out_device)
    top = torch.where(found, u[:, 0] * (height - h_box + 1), (height - h_box) / 2).floor()
    left = torch.where(found, u[:, 1] * (width - w_box + 1), (width - w_box) / 2).floor()
    return torch.stack([top, left, h_box, w_box], dim=1).to(torch.int64)


def _first_fit(
    hw: Tensor,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """All tries of every sample at once: (any try fits, h and w of the first fit), float64."""
    height, width = hw[:, :1], hw[:, 1:]  # (N, 1) each, broadcast against the tries
    u = _rand((hw.shape[0], _RRC_TRIES, 2), generator, hw.device)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    log_r0, log_r1 = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_r0 + (log_r1 - log_r0) * u[..., 1])
    # torch.round rounds half to even, like Python's round() in the reference algorithm.
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # argmax returns the first maximum
    return fits.any(dim=1), h.gather(1, first)[:, 0], w.gather(1, first)[:, 0]


def center_crop_params(
    height: int, width: int, size: int, resize_ratio: float = 256 / 224
) -> tuple[int, int, int, int]:
    """Geometry of eval "resize shorter side, then centre crop" (torchvision Resize + CenterCrop).

    The shorter side becomes ``floor(size * resize_ratio)``, the longer side
    ``int(short * long_in / short_in)``; the crop starts at ``round((resized - size) / 2)`` (Python
    rounding) on each axis.

    Returns:
        ``(resized_height, resized_width, top, left)``: the crop is ``size`` squared at (top, left).
    """
    if resize_ratio < 1:
        raise ValueError(f"resize_ratio must be >= 1 (got {resize_ratio}): the crop must fit")
    # The epsilon keeps e.g. 224 * (256 / 224) at 256 despite float rounding.
    short = math.floor(size * resize_ratio + 1e-6)
    if height <= width:
        resized_h, resized_w = short, int(short * width / height)
    else:
        resized_h, resized_w = int(short * height / width), short
    top = int(round((resized_h - size) / 2.0))
    left = int(round((resized_w - size) / 2.0))
    return resized_h, resized_w, top, left


def _check_ranges(scale: tuple[float, float], ratio: tuple[float, float]) -> None:
    if not 0 < scale[0] <= scale[1]:
        raise ValueError(f"scale must be (low, high) with 0 < low <= high, got {scale}")
    if not 0 < ratio[0] <= ratio[1]:
        raise ValueError(f"ratio must be (low, high) with 0 < low <= high, got {ratio}")


# ----------------------------------------------------------------------------- kernels
def crop_with_padding(x: Tensor, pad: int, offsets: Tensor, flip: Tensor | None = None) -> Tensor:
    """Per-sample ``H x W`` window of the batch zero-padded by `pad` pixels on every side.

    Args:
        x: ``(N, C, H, W)`` batch, any dtype.
        pad: padding in pixels.
        offsets: int ``(N, 2)`` window origins ``(dy, dx)`` in the padded image, in [0, 2 * pad].
        flip: optional boolean ``(N,)``: mirror these windows left-right (in the same pass).

    Returns:
        ``(N, C, H, W)`` tensor of x's dtype.
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    wp = w + 2 * pad
    # One gather over the flattened padded image: window pixel (i, j) of sample k sits at
    # (dy_k + i) * wp + dx_k + j (j -> w - 1 - j when mirrored). On CPU this beats unfold views,
    # 4-tensor advanced indexing and a separate flip pass; on CUDA it is one kernel, no host sync.
    offsets = offsets.to(x.device)
    start = (offsets[:, 0] * wp + offsets[:, 1])[:, None, None]
    rows = torch.arange(h, device=x.device)[:, None] * wp
    cols = torch.arange(w, device=x.device)
    if flip is not None:
        cols = torch.where(flip.to(x.device)[:, None, None], w - 1 - cols, cols)
    index = (start + rows + cols).reshape(n, 1, h * w).expand(n, c, h * w)
    return padded.reshape(n, c, -1).gather(2, index).reshape(n, c, h, w)


def random_crop_with_padding(
    x: Tensor, pad: int, generator: torch.Generator | None = None, flip_p: float = 0.0
) -> Tensor:
    """`crop_with_padding` at offsets drawn uniformly from [0, 2 * pad] (torchvision RandomCrop).

    With ``flip_p > 0`` each window is also mirrored with that probability, in the same gather;
    the draws are those of this function with ``flip_p=0`` followed by `random_flip`, so the result
    equals that pair of calls with the same generator.
    """
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    u = _rand((x.shape[0], 2), generator, x.device)
    offsets = torch.floor(u * (2 * pad + 1)).to(torch.int64)
    flip = _rand((x.shape[0],), generator, x.device) < flip_p if flip_p > 0 else None
    return crop_with_padding(x, pad, offsets, flip)


def flip_horizontal(x: Tensor, mask: Tensor) -> Tensor:
    """Mirror left-right the samples where the boolean ``(N,)`` `mask` is True; keep the others."""
    n, c, h, w = x.shape
    cols = torch.arange(w, device=x.device)
    # A gather with per-sample column order: one pass, no host sync (unlike x[mask] indexing).
    index = torch.where(mask.to(x.device)[:, None], w - 1 - cols, cols)
    return x.gather(3, index[:, None, None, :].expand(n, c, h, w))


def random_flip(x: Tensor, generator: torch.Generator | None = None, p: float = 0.5) -> Tensor:
    """`flip_horizontal` of each sample with probability `p`."""
    return flip_horizontal(x, _rand((x.shape[0],), generator, x.device) < p)


def _resize_weights(
    start: Tensor, length: Tensor, in_size: int, out_size: int, antialias: bool
) -> Tensor:
    """``(N, out_size, in_size)`` bilinear weights resizing ``[start, start + length)``.

    The filter of PIL and ``F.interpolate(antialias=True)``: output pixel i is centred at
    ``(i + 0.5) * scale`` in the crop, triangle filter of half-width ``max(scale, 1)`` (1 without
    antialias); taps outside the crop are dropped and the rest renormalized (the same as clamping
    at the crop's edge, so this equals "crop, then resize").
    """
    start, length = start.to(torch.float32)[:, None, None], length.to(torch.float32)[:, None, None]
    scale = length / out_size
    support = scale.clamp(min=1.0) if antialias else torch.ones_like(scale)
    centre = (
        torch.arange(out_size, device=start.device, dtype=torch.float32)[:, None] + 0.5
    ) * scale
    pos = torch.arange(in_size, device=start.device, dtype=torch.float32) + 0.5 - start
    weights = (1 - (pos - centre).abs() / support).clamp(min=0) * ((pos > 0) & (pos < length))
    return weights / weights.sum(dim=2, keepdim=True).clamp(min=1e-12)


def _as_hw(size: _Size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _separable(x: Tensor, wy: Tensor, wx: Tensor) -> Tensor:
    """``wy @ x @ wx^T`` per sample, in the order with fewer multiply-adds."""
    # Dense weight matrices cost O(H) multiply-adds per output pixel where a gather of the few
    # filter taps would cost O(taps), but they give the exact antialiased filter with per-sample
    # boxes in two batched matmuls (tensor cores on GPU: ~0.2 GFLOP per 256px image, far below a
    # training step), with no data-dependent shapes and no host sync.
    x = x if x.is_floating_point() else x.to(torch.float32)
    wy, wxt = wy[:, None].to(x.dtype), wx.transpose(1, 2)[:, None].to(x.dtype)
    (oh, h), (w, ow) = wy.shape[-2:], wxt.shape[-2:]
    if oh * h * w + oh * w * ow <= h * w * ow + oh * h * ow:
        return (wy @ x) @ wxt
    return wy @ (x @ wxt)


def resized_crop(x: Tensor, boxes: Tensor, size: _Size, antialias: bool = True) -> Tensor:
    """Crop every sample to its own box, then resize it bilinearly to `size` (one batched op).

    Args:
        x: ``(N, C, H, W)`` batch, uint8 or float (0..255 scale).
        boxes: int ``(N, 4)`` boxes ``(top, left, h, w)``, each inside the image (not checked on the
            device, to avoid a host sync).
        size: output side, or ``(height, width)``.
        antialias: low-pass when shrinking, like PIL and torchvision.

    Returns:
        Float ``(N, C, *size)`` tensor (float32 unless x is another float dtype), 0..255 scale.
    """
    out_h, out_w = _as_hw(size)
    boxes = boxes.to(x.device)
    wy = _resize_weights(boxes[:, 0], boxes[:, 2], x.shape[2], out_h, antialias)
    wx = _resize_weights(boxes[:, 1], boxes[:, 3], x.shape[3], out_w, antialias)
    return _separable(x, wy, wx)


def resize_center_crop(
    x: Tensor, size: int, resize_ratio: float = 256 / 224, antialias: bool = True
) -> Tensor:
    """Resize the shorter side to ``floor(size * resize_ratio)``, then crop the centre `size`.

    Geometry from `center_crop_params`; only the rows and columns of the crop are computed.

    Returns:
        Float ``(N, C, size, size)`` tensor, 0..255 scale.
    """
    _, _, h, w = x.shape
    resized_h, resized_w, top, left = center_crop_params(h, w, size, resize_ratio)
    zero = torch.zeros(1, device=x.device)
    wy = _resize_weights(zero, zero + h, h, resized_h, antialias)[:, top : top + size]
    wx = _resize_weights(zero, zero + w, w, resized_w, antialias)[:, left : left + size]
    return _separable(x, wy, wx)


@lru_cache(maxsize=64)
def _mean_std(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    # Cached so a CUDA step does not copy two tiny host tensors to the device every batch.
    if len(mean) != len(std) or any(s <= 0 for s in std):
        raise ValueError(f"need one mean and one positive std per channel, got {mean} and {std}")
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32, device=device) for v in (mean, std))
    return mean_t.view(1, -1, 1, 1), std_t.view(1, -1, 1, 1)


def normalize(
    x: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> Tensor:
    """``(x - mean) / std`` per channel, computed in float32 and returned as `dtype`.

    Args:
        x: ``(N, C, H, W)`` batch, uint8 or float on the 0..255 scale (never modified).
        mean: C channel means, 0..255 scale.
        std: C channel standard deviations, 0..255 scale.
        dtype: floating dtype of the result.
        channels_last: return the channels-last memory format (same NCHW shape).
    """
    if x.dim() != 4 or x.shape[1] != len(mean):
        raise ValueError(f"expected an (N, {len(mean)}, H, W) batch, got shape {tuple(x.shape)}")
    mean_t, std_t = _mean_std(tuple(map(float, mean)), tuple(map(float, std)), x.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = x.to(dtype=torch.float32, memory_format=fmt, copy=True).sub_(mean_t).div_(std_t)
    return out if dtype == torch.float32 else out.to(dtype)


# ----------------------------------------------------------------------------- presets
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
            if op.name not in OPS:
                raise ValueError(
                    f"preset {self.name!r}: unknown op {op.name!r}; known: {sorted(OPS)}"
                )
            if op.name in _SIZED_OPS and self.image_size is None:
                raise ValueError(f"preset {self.name!r}: op {op.name!r} needs image_size")

    def apply(self, x: Tensor, train: bool, generator: torch.Generator | None = None) -> Tensor:
        """Augment (train) or just prepare (eval) a uint8 ``(N, C, H, W)`` batch on its device.

        Args:
            x: uint8 batch, contiguous or channels-last (float on the 0..255 scale also works).
            train: use `train_ops` (True) or `eval_ops` (False).
            generator: torch generator for reproducible random draws (CPU or the batch's device).

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
        return normalize(x, self.mean, self.std, self.dtype, self.channels_last)


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
    return Preset("photo", image_size or 224, mean, std, (_FLIP,))


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
    """The preset called `name` (see the module docstring), optionally with other size / statistics.

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
