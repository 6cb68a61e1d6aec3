"""Batched crop + antialiased resize of decoded images of any size: a few tensor ops a batch.

The nvjpeg backend's geometry step (`fastdata.read.backends.nvjpeg`). Resizing a crop with
antialiased bilinear filtering is separable: ``out = Wy @ crop @ Wx.T``, with Wy (out_h x h) and
Wx (out_w x w) the filter's weights. Written on the whole image instead of the crop (weights zero
outside the crop's rows and columns), every image of one stored size shares one tensor shape, so
a batch is: per distinct image size, one stack, two batched matmuls and the weights (built for
the group in a few vectorized ops); then one rounding and uint8 cast for the batch. A flip is the
column weights reversed. Photo sets have a handful of stored sizes, so a batch of 128 costs
~10-20 kernel launches where a loop of per-image `interpolate` costs ~5 per image.

The dense weights cost ``out_h x H x W`` multiply-adds an image where a filter that skips zeros
costs ~``taps x crop``: nothing on a GPU for photos of ~0.2 MP (clothing-small, ImageNet), but
~16 GFLOP an image at 12 MP. Images over `DENSE_MAX_PIXELS` therefore take a per-image
`interpolate` of their crop (the pixels agree within one level), and a group is stacked in
chunks of at most `CHUNK_BYTES` of floats.

The weights are those of `torch.nn.functional.interpolate(mode="bilinear", antialias=True)`
(Pillow's boxed bilinear): for output pixel i of a crop starting at s with scale k = in / out,
centre c = s + k (i + 0.5), source pixel j weighs ``max(0, 1 - |j + 0.5 - c| / max(k, 1))``
over the crop's pixels, normalized. The ops are plain torch: the same code runs (and is tested)
on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_BYTES", "DENSE_MAX_PIXELS", "Box", "crop_resize", "filter_weights"]

#: (left, top, right, bottom) in full-resolution pixels: `fastdata.read.decoders.image.draw_crop`.
Box = tuple[int, int, int, int]

#: Images of more pixels than this are resized one by one (`interpolate` of the crop).
DENSE_MAX_PIXELS = 1 << 20
#: The most bytes of float images stacked at once for the dense path.
CHUNK_BYTES = 256 << 20


def filter_weights(
    start: torch.Tensor, length: torch.Tensor, in_size: int, out_size: int
) -> torch.Tensor:
    """(G, out_size, in_size) antialiased bilinear weights of G crops of one axis.

    Args:
        start: (G,) float: each crop's first pixel on this axis.
        length: (G,) float: each crop's length on this axis (>= 1).
        in_size: the images' size on this axis.
        out_size: the output size on this axis.
    """
    scale = length / out_size  # (G,)
    support = scale.clamp(min=1.0)
    steps = torch.arange(out_size, dtype=torch.float32, device=start.device) + 0.5
    centre = start[:, None] + scale[:, None] * steps  # (G, out)
    pixel = torch.arange(in_size, dtype=torch.float32, device=start.device) + 0.5  # (in,)
    dist = (pixel[None, None, :] - centre[:, :, None]).abs_() / support[:, None, None]
    weights = (1.0 - dist).clamp_(min=0.0)
    inside = (pixel[None, :] > start[:, None]) & (pixel[None, :] < (start + length)[:, None])
    weights.mul_(inside[:, None, :])
    return weights / weights.sum(dim=-1, keepdim=True).clamp_(min=1e-12)


def crop_resize(
    images: Sequence[torch.Tensor],
    boxes: Sequence[Box],
    out_hw: tuple[int, int],
    flips: Sequence[bool],
) -> torch.Tensor:
    """Crop each CHW uint8 image to its box, resize to `out_hw`, mirror where flagged: NCHW uint8.

    Runs on the images' device, one group of ops per distinct image size (module doc).

    Args:
        images: CHW uint8 tensors (3 or more channels: the first 3 are kept), one device.
        boxes: (left, top, right, bottom) of each image's crop, inside the image.
        out_hw: the output (height, width).
        flips: mirror each output left-right.

    Raises:
        ValueError: no images, or a box or flip list of another length, or a box outside its
            image.
    """
    if not images:
        raise ValueError("crop_resize needs at least one image")
    if len(flips) != len(images) or len(boxes) != len(images):
        raise ValueError(
            f"crop_resize: {len(images)} images but {len(boxes)} boxes and {len(flips)} flips"
        )
    device = images[0].device
    out_h, out_w = out_hw
    out = torch.empty((len(images), 3, out_h, out_w), dtype=torch.float32, device=device)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (image, (left, top, right, bottom)) in enumerate(zip(images, boxes, strict=True)):
        height, width = int(image.shape[-2]), int(image.shape[-1])
        if not (0 <= left < right <= width and 0 <= top < bottom <= height):
            raise ValueError(
                f"crop_resize: box {boxes[i]} of image {i} is not inside its {width}x{height} "
                "pixels"
            )
        groups.setdefault((height, width), []).append(i)
    for (height, width), index in groups.items():
        if height * width > DENSE_MAX_PIXELS:
            for i in index:
                out[i] = _one(images[i], boxes[i], out_hw, flips[i])
            continue
        step = max(1, CHUNK_BYTES // (3 * height * width * 4))
        for first in range(0, len(index), step):
            chunk = index[first : first + step]
            resized = _dense(images, boxes, flips, chunk, (height, width), out_hw)
            if len(chunk) == len(images):
                out = resized
            else:
                out[torch.tensor(chunk, device=device)] = resized
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _dense(
    images: Sequence[torch.Tensor],
    boxes: Sequence[Box],
    flips: Sequence[bool],
    index: list[int],
    in_hw: tuple[int, int],
    out_hw: tuple[int, int],
) -> torch.Tensor:
    """Images `index` (all of size `in_hw`) cropped, resized and flipped: (G, 3, oh, ow) float."""
    device = images[index[0]].device
    box = torch.tensor([boxes[i] for i in index], dtype=torch.float32).to(device)
    wy = filter_weights(box[:, 1], box[:, 3] - box[:, 1], in_hw[0], out_hw[0])  # (G, oh, H)
    wx = filter_weights(box[:, 0], box[:, 2] - box[:, 0], in_hw[1], out_hw[1])  # (G, ow, W)
    flip = torch.tensor([flips[i] for i in index], dtype=torch.bool).to(device)
    wx = torch.where(flip[:, None, None], wx.flip(1), wx)
    stack = torch.stack([images[i][:3] for i in index]).float()  # (G, 3, H, W)
    rows = torch.matmul(wy[:, None], stack)  # (G, 3, oh, W)
    return torch.matmul(rows, wx[:, None].transpose(-1, -2))  # (G, 3, oh, ow)


def _one(image: torch.Tensor, box: Box, out_hw: tuple[int, int], flip: bool) -> torch.Tensor:
    """One image's crop resized by `interpolate` (antialiased bilinear), flipped: (3, oh, ow)."""
    left, top, right, bottom = box
    crop = image[None, :3, top:bottom, left:right].float()
    resized = F.interpolate(crop, size=out_hw, mode="bilinear", antialias=True)[0]
    return resized.flip(-1) if flip else resized
