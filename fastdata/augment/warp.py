"""Kernels of `fastdata.augment.targets`: a batch of regions applied to images, masks and boxes.

Every function takes per-sample regions (`fastdata.augment.region.Region`) and works the same on
CPU and CUDA tensors; `targets.warp_sample` calls them with a batch of one, so a sample warped in a
worker and a batch warped on the device give the same result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fastdata.augment.kernels import EDGE_EPS, resize_weights, separable
from fastdata.augment.region import Region

__all__ = [
    "as_chw",
    "box_params",
    "check_boxes",
    "fast_image",
    "gatherable",
    "map_boxes",
    "warp_box_lists",
    "warp_images",
    "warp_masks",
]


def check_boxes(
    boxes: Tensor | np.ndarray, box_labels: Tensor | np.ndarray | None, where: str
) -> tuple[Tensor, Tensor | None]:
    """float64 ``(k, 4)`` boxes and int64 ``(k,)`` labels (or None), or a ValueError."""
    b = torch.as_tensor(boxes)
    if b.numel() == 0:
        b = b.reshape(0, 4)
    if b.dim() != 2 or b.shape[1] != 4:
        raise ValueError(f"{where}boxes must have shape (k, 4) xyxy, got {tuple(b.shape)}")
    labels = None if box_labels is None else torch.as_tensor(box_labels).reshape(-1)
    if labels is not None and labels.shape[0] != b.shape[0]:
        raise ValueError(f"{where}got {b.shape[0]} boxes but {labels.shape[0]} box labels")
    return b.to(torch.float64), None if labels is None else labels.to(torch.int64)


def box_params(region: Region, in_hw: tuple[int, int]) -> list[float]:
    """One row of `map_boxes`'s parameters: box, flip, output and source sizes."""
    (oh, ow), (h, w) = region.out_hw, in_hw
    return [*region.box, float(region.flip), oh, ow, h, w]


def map_boxes(b: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """(mapped and clipped float32 boxes, keep flags) of boxes `b` with per-box parameters `p`.

    Computed in float64 (the same on every device), rounded to float32, then a box with no width
    or no height left is flagged for dropping.
    """
    x0, y0, x1, y1, flip, oh, ow, h, w = p.unbind(1)
    fx, fy = ow / (x1 - x0), oh / (y1 - y0)
    clipped = torch.minimum(b.clamp(min=0), torch.stack([w, h, w, h], 1))
    m = (clipped - torch.stack([x0, y0, x0, y0], 1)) * torch.stack([fx, fy, fx, fy], 1)
    mirrored = torch.stack([ow - m[:, 2], m[:, 1], ow - m[:, 0], m[:, 3]], 1)
    m = torch.where((flip > 0)[:, None], mirrored, m)
    out = torch.minimum(m.clamp(min=0), torch.stack([ow, oh, ow, oh], 1))
    out = out.to(torch.float32)  # then the area test: a sliver may round to nothing in float32
    return out, (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])


# ----------------------------------------------------------------------------- masks
def nearest_index(start: Tensor, length: Tensor, out: int, flip: Tensor | None) -> Tensor:
    """``(N, out)`` int64 source index under each output pixel's centre (float64 arithmetic)."""
    i = torch.arange(out, device=start.device, dtype=torch.float64)
    if flip is not None:
        i = torch.where(flip[:, None], (out - 1) - i, i)
    step = length[:, None] / out
    return torch.floor(start[:, None] + (i + 0.5) * step).to(torch.int64)


def warp_masks(masks: Tensor, regions: Sequence[Region], ignore_index: int) -> Tensor:
    """Nearest warp of ``(N, H, W)`` masks by per-sample regions (one gather) -> int64.

    Output pixels whose centre falls outside the image get `ignore_index`.
    """
    n, h, w = masks.shape
    oh, ow = regions[0].out_hw
    dev = masks.device
    boxes = torch.tensor([r.box for r in regions], dtype=torch.float64, device=dev)
    flip = torch.tensor([r.flip for r in regions], dtype=torch.bool, device=dev)
    rows = nearest_index(boxes[:, 1], boxes[:, 3] - boxes[:, 1], oh, None)
    cols = nearest_index(boxes[:, 0], boxes[:, 2] - boxes[:, 0], ow, flip)
    # One gather over the flattened maps (several times faster than 3-tensor advanced indexing).
    flat = (rows.clamp(0, h - 1) * w)[:, :, None] + cols.clamp(0, w - 1)[:, None, :]
    values = masks.reshape(n, h * w).gather(1, flat.reshape(n, oh * ow)).reshape(n, oh, ow)
    values = values.to(torch.int64)
    if all(r.box[0] >= 0 and r.box[1] >= 0 and r.box[2] <= w and r.box[3] <= h for r in regions):
        return values  # every centre falls inside the image (known on the host: no sync)
    valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    return values.masked_fill_(~valid, ignore_index)


# ----------------------------------------------------------------------------- images
def warp_images(
    images: Tensor, regions: Sequence[Region], antialias: bool, dtype: torch.dtype
) -> Tensor:
    """Batched resample of ``(N, C, H, W)`` images by per-sample regions."""
    n, _, h, w = images.shape
    oh, ow = regions[0].out_hw
    dev = images.device
    # Built on the host (a few hundred numbers), sent in one non-blocking copy each.
    boxes = torch.tensor([r.box for r in regions], dtype=torch.float64).to(dev, non_blocking=True)
    flip = torch.tensor([r.flip for r in regions], dtype=torch.bool).to(dev, non_blocking=True)
    pad_y, pad_x = _reach(regions, 1, h), _reach(regions, 0, w)
    wy = resize_weights(boxes[:, 1], boxes[:, 3] - boxes[:, 1], h, oh, antialias, None, pad_y)
    wx = resize_weights(boxes[:, 0], boxes[:, 2] - boxes[:, 0], w, ow, antialias, flip, pad_x)
    out = separable(images, wy, wx)
    return finish_pixels(out, dtype)


def _reach(regions: Sequence[Region], axis: int, size: int) -> tuple[int, int]:
    """Whole pixels the regions' boxes reach past the start and the end of one axis."""
    lo = max(0, max(math.ceil(-r.box[axis] - EDGE_EPS) for r in regions))
    hi = max(0, max(math.ceil(r.box[axis + 2] - size - EDGE_EPS) for r in regions))
    return lo, hi


def finish_pixels(x: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype == torch.uint8:
        return x.round().clamp_(0, 255).to(torch.uint8)
    return x.to(dtype)


def fast_image(image: Tensor, region: Region) -> Tensor:
    """`warp_sample`'s image for a whole-pixel box: zero-padded crop, torch's uint8 resize, flip."""
    c, h, w = image.shape
    x0, y0, x1, y1 = (int(v) for v in region.box)
    ix0, iy0, ix1, iy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if (ix0, iy0, ix1, iy1) == (x0, y0, x1, y1):
        crop = image[:, y0:y1, x0:x1]
    else:
        crop = image.new_zeros((c, y1 - y0, x1 - x0))
        if ix1 > ix0 and iy1 > iy0:
            crop[:, iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0] = image[:, iy0:iy1, ix0:ix1]
    if tuple(crop.shape[1:]) != region.out_hw:
        # channels-last (1, C, h, w): the vectorized uint8 antialiased bilinear kernel.
        crop = crop.permute(1, 2, 0).contiguous().permute(2, 0, 1)[None]
        crop = F.interpolate(crop, size=region.out_hw, mode="bilinear", antialias=True)[0]
    if region.flip:
        crop = crop.flip(-1)
    return crop.contiguous()


def as_chw(image: np.ndarray | Tensor, layout: str | None) -> Tensor:
    """uint8 CHW tensor of an HWC (numpy default) or CHW (tensor default) image."""
    if isinstance(image, np.ndarray):
        # torch warns on read-only arrays (Pillow's np.asarray): copy those, never write to them
        writable = image.flags.writeable and image.flags.c_contiguous
        t = torch.from_numpy(image if writable else np.array(image, order="C"))
    else:
        t = image
    if t.dim() == 2:
        return t[None]
    if t.dim() != 3:
        raise ValueError(f"image must be HWC or CHW, got shape {tuple(t.shape)}")
    if layout is None:
        hwc_like, chw_like = t.shape[-1] in (1, 3, 4), t.shape[0] in (1, 3, 4)
        layout = "HWC" if hwc_like and (not chw_like or isinstance(image, np.ndarray)) else "CHW"
    if layout not in ("HWC", "CHW"):
        raise ValueError(f"layout must be 'HWC' or 'CHW', got {layout!r}")
    return t.permute(2, 0, 1) if layout == "HWC" else t


def gatherable(mask: Tensor) -> Tensor:
    """Masks in a dtype `gather` takes on every device (uint16 widened to int32)."""
    return mask.to(torch.int32) if mask.dtype in (torch.uint16, torch.uint32) else mask


def warp_box_lists(
    boxes: Sequence[Tensor],
    box_labels: Sequence[Tensor] | None,
    regions: Sequence[Region],
    in_hw: tuple[int, int],
) -> dict[str, list[Tensor]]:
    """`warp_boxes` of every sample in one vectorized pass."""
    if len(boxes) != len(regions) or (box_labels is not None and len(box_labels) != len(regions)):
        raise ValueError(
            f"need one boxes (and box_labels) entry per image, got {len(boxes)} for {len(regions)}"
        )
    pairs = [
        check_boxes(b, None if box_labels is None else box_labels[i], f"sample {i}: ")
        for i, b in enumerate(boxes)
    ]
    counts = [b.shape[0] for b, _ in pairs]
    dev = pairs[0][0].device
    cat = torch.cat([b.to(dev) for b, _ in pairs])
    params = torch.tensor([box_params(r, in_hw) for r in regions], dtype=torch.float64, device=dev)
    mapped, keep = map_boxes(cat, params.repeat_interleave(torch.tensor(counts, device=dev), 0))
    kept = keep.split(counts)
    result = {"boxes": [m[k] for m, k in zip(mapped.split(counts), kept, strict=True)]}
    if box_labels is not None:
        result["box_labels"] = [lab.to(dev)[k] for (_, lab), k in zip(pairs, kept, strict=True)]
    return result
