"""Pure batched kernels: crops, flips, resizes and normalization of ``(N, C, H, W)`` batches.

See the `fastdata.augment` package docstring for the resize filter and normalization semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fastdata._util.native import pixels as _pixels  # None: not built (numpy does it)
from fastdata.augment.params import _rand, center_crop_box, pad_crop_params

__all__ = [
    "crop_with_padding",
    "flip_horizontal",
    "normalize",
    "random_crop_with_padding",
    "random_flip",
    "resize_center_crop",
    "resize_weights",
    "resized_crop",
    "separable",
]

_Size = int | tuple[int, int]


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
    offsets, flip = pad_crop_params(x.shape[0], pad, generator, x.device, flip_p)
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


#: Pixels: a span edge closer than this to a pixel boundary is taken as on it.
EDGE_EPS = 1e-3


def resize_weights(
    start: Tensor,
    length: Tensor,
    in_size: int,
    out: int,
    antialias: bool,
    flip: Tensor | None = None,
    pad: tuple[int, int] = (0, 0),
) -> Tensor:
    """``(N, out, in_size)`` float32 resize weights of per-sample spans of a zero-extended axis.

    Output pixel i is centred at ``start + (i + 0.5) * scale`` (``scale = length / out``), with a
    triangle filter of half-width ``max(scale, 1)`` (1 without antialias): the filter of PIL and
    ``F.interpolate(antialias=True)``. Its taps are the pixels the span touches (for a span on
    whole pixels: the pixels inside it, i.e. "crop, then resize"); taps past the axis' ends are
    zero-valued padding: they count in the normalization and are then cut off. `pad` says how
    many pixels the spans reach past each end (computed by the caller from host numbers: no sync).

    Args:
        start: ``(N,)`` span starts in pixels (whole or fractional).
        length: ``(N,)`` span lengths in pixels.
        in_size: the axis' length in pixels.
        out: output pixels per span.
        antialias: low-pass when shrinking, like PIL and torchvision.
        flip: optional boolean ``(N,)``: mirror these spans' outputs.
        pad: whole pixels the spans reach past the axis' start and end.
    """
    lo, hi = pad
    dev, f32 = start.device, torch.float32
    start, length = start.to(f32)[:, None, None], length.to(f32)[:, None, None]
    scale = length / out
    support = scale.clamp(min=1.0) if antialias else torch.ones_like(scale)
    centre = (torch.arange(out, dtype=f32, device=dev)[:, None] + 0.5) * scale
    pos = torch.arange(-lo, in_size + hi, dtype=f32, device=dev) + 0.5 - start  # tap centres
    # A pixel counts when the span covers more than a thousandth of it: float noise in a box
    # edge (e.g. -1e-15) must not pull in a padding pixel.
    touched = (pos > -0.5 + EDGE_EPS) & (pos < length + 0.5 - EDGE_EPS)
    wts = (1 - (pos - centre).abs() / support).clamp(min=0) * touched
    wts = wts / wts.sum(dim=2, keepdim=True).clamp(min=1e-12)
    wts = wts[:, :, lo : lo + in_size]
    if flip is not None:
        wts = torch.where(flip[:, None, None], wts.flip(1), wts)
    return wts


def _as_hw(size: _Size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def separable(x: Tensor, wy: Tensor, wx: Tensor) -> Tensor:
    """``wy @ x @ wx^T`` per sample (weights of `resize_weights`), in the order with fewer
    multiply-adds; uint8 input is computed in float32."""
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
    wy = resize_weights(boxes[:, 0], boxes[:, 2], x.shape[2], out_h, antialias)
    wx = resize_weights(boxes[:, 1], boxes[:, 3], x.shape[3], out_w, antialias)
    return separable(x, wy, wx)


def resize_center_crop(
    x: Tensor, size: int, resize_ratio: float = 256 / 224, antialias: bool = True
) -> Tensor:
    """The evaluation centre crop: `center_crop_box`'s box of the batch's images, resized to
    `size` (the decoders' geometry: crop, then resize).

    Returns:
        Float ``(N, C, size, size)`` tensor, 0..255 scale.
    """
    n, _, h, w = x.shape
    box = torch.tensor([center_crop_box(h, w, size, resize_ratio)]).expand(n, 4)
    return resized_crop(x, box, size, antialias)


@lru_cache(maxsize=64)
def _mean_std(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    # Cached so a CUDA step does not copy two tiny host tensors to the device every batch; made
    # outside inference mode (a first call from an evaluation under torch.inference_mode), else a
    # later call whose input needs gradients fails: "Inference tensors cannot be saved for
    # backward".
    if len(mean) != len(std) or any(s <= 0 for s in std):
        raise ValueError(f"need one mean and one positive std per channel, got {mean} and {std}")
    with torch.inference_mode(False):
        mean_t, std_t = (torch.tensor(v, dtype=torch.float32, device=device) for v in (mean, std))
    return mean_t.view(1, -1, 1, 1), std_t.view(1, -1, 1, 1)


# A CPU normalization of uint8 images goes through a table of the 256 results per channel
# (`fastdata/_pixels.c`, built at install; one byte read and one float written per value, no
# arithmetic), else numpy a cache-sized chunk at a time (the chunk stays in the cache between the
# subtraction and the division). Both run on the calling thread, bit for bit the subtraction and
# division: torch's intra-op threads, woken for each op, spin-wait on the cores the loader's
# workers need. Measured with 2 workers on 2 cores, 64 x 224 px photos: 1,309-1,370 img/s and
# 1.38-1.46 ms of CPU an image in all processes with torch's three whole-batch ops, 1,495-1,523
# img/s and 1.25-1.28 ms with numpy; one core, cold caches: 0.18-0.26 ms an image with numpy, 0.12
# with the table.
_CHUNK_BYTES = 1 << 20
_NUMPY_DTYPES = (torch.uint8, torch.float32)


@lru_cache(maxsize=64)
def _table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(C, 256) float32: (v - mean[c]) / std[c] for every byte v, in float32 arithmetic."""
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32).view(-1, 1) for v in (mean, std))
    values = torch.arange(256, dtype=torch.float32).view(1, -1)
    return ((values - mean_t) / std_t).contiguous().numpy()


def _normalize_cpu(
    x: Tensor, mean: tuple[float, ...], std: tuple[float, ...], out: Tensor
) -> Tensor:
    """``out = (x - mean) / std`` in float32 on the CPU, on the calling thread."""
    channels = x.shape[1]
    if _pixels is not None and x.dtype == torch.uint8 and x.numel() > 0:
        planar = x.is_contiguous() and out.is_contiguous()
        if planar or (
            x.is_contiguous(memory_format=torch.channels_last)
            and out.is_contiguous(memory_format=torch.channels_last)
        ):
            # numpy views of the memory as it lies: planes (N, C, H, W) or pixels (N, H, W, C)
            xs = x.detach() if planar else x.detach().permute(0, 2, 3, 1)
            outs = out.detach() if planar else out.detach().permute(0, 2, 3, 1)
            table = _table(mean, std)
            if planar:
                _pixels.normalize_planes(
                    xs.numpy(), outs.numpy(), table, channels, x.shape[2] * x.shape[3]
                )
            else:
                _pixels.normalize_pixels(xs.numpy(), outs.numpy(), table, channels)
            return out
    mean_t, std_t = _mean_std(mean, std, x.device)
    per_image = out[0].numel() * out.element_size() if len(out) else 1
    step = max(1, _CHUNK_BYTES // max(1, per_image))
    xs, outs = x.detach().numpy(), out.detach().numpy()
    mean_a, std_a = mean_t.numpy(), std_t.numpy()
    for i in range(0, len(xs), step):
        chunk = outs[i : i + step]
        np.subtract(xs[i : i + step], mean_a, out=chunk, dtype=np.float32)
        np.divide(chunk, std_a, out=chunk)
    return out


def normalize(
    x: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """``(x - mean) / std`` per channel, computed in float32 and returned as `dtype`.

    Args:
        x: ``(N, C, H, W)`` batch, uint8 or float on the 0..255 scale (never modified).
        mean: C channel means, 0..255 scale.
        std: C channel standard deviations, 0..255 scale.
        dtype: floating dtype of the result.
        channels_last: return the channels-last memory format (same NCHW shape).
        out: optional tensor of x's shape, `dtype` and memory format to write the result into
            (e.g. from `fastdata._util.pool.TensorPool`: no page faults for a fresh CPU tensor).
    """
    if x.dim() != 4 or x.shape[1] != len(mean):
        raise ValueError(f"expected an (N, {len(mean)}, H, W) batch, got shape {tuple(x.shape)}")
    mean, std = tuple(map(float, mean)), tuple(map(float, std))
    mean_t, std_t = _mean_std(mean, std, x.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    on_cpu = x.device.type == "cpu" and dtype == torch.float32 and x.dtype in _NUMPY_DTYPES
    # numpy does not track gradients: a float input that needs them takes torch's ops
    on_cpu = on_cpu and not (
        torch.is_grad_enabled() and (x.requires_grad or (out is not None and out.requires_grad))
    )
    if on_cpu and (
        out is None
        or (out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == x.shape)
    ):
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, memory_format=fmt)
        return _normalize_cpu(x, mean, std, out)
    if out is not None and dtype == torch.float32:
        return out.copy_(x).sub_(mean_t).div_(std_t)
    result = x.to(dtype=torch.float32, memory_format=fmt, copy=True).sub_(mean_t).div_(std_t)
    if out is not None:
        return out.copy_(result)
    return result if dtype == torch.float32 else result.to(dtype)
