"""Resizing decoded crops to the output size on the CPU (torch's uint8 antialiased bilinear kernel).

`resize_aa`: torch's kernel gives the pixels of Pillow's ``resize(size, BILINEAR)`` (torchvision's
`resized_crop` on a PIL image: tests/read/decoders/test_decode.py) without Pillow's RGB -> RGBX -> RGB
conversions. `cover`: a whole image (Pillow-SIMD, DCT-scaled) resized to cover a size, centre kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image

from fastdata._util.native import pixels as _pixels  # None: not built

__all__ = ["cover", "cover_box", "resize_aa"]

# The ATen op behind `F.interpolate(..., mode="bilinear", antialias=True)`, with an `out` tensor
# (`resize_aa`); None where this torch lacks it (`interpolate` is used then).
_RESIZE_OUT = getattr(getattr(torch.ops.aten, "_upsample_bilinear2d_aa", None), "out", None)


def resize_aa(
    region: torch.Tensor, size: int, flip: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.interpolate(region, (size, size), mode="bilinear", antialias=True)[0]`, planar, cheaper.

    The uint8 kernel works on interleaved pixels; asked for a planar output (what `interpolate`
    returns for a (1, 3, h, w) channels-last input) it writes it a byte at a time (`pack_rgb`: 7%
    of the photo loader's CPU time in `perf`). Resized into a channels-last tensor and copied to
    planar by torch's copy kernel instead: the same pixels, ~0.08 ms an image less at 224 px
    (clothing-small crops; 0.30 against 0.39 ms for the resize and the batch's copy).

    Args:
        region: (1, 3, h, w) uint8, channels-last.
        size: the output side.
        flip: mirror the result left-right.
        out: a contiguous (3, size, size) uint8 tensor to write the result into (a slot of the
            batch: no copy of the image into the batch afterwards).

    Returns:
        (3, size, size) uint8, contiguous: `out` when given.
    """
    if _RESIZE_OUT is None or region.shape[1] != 3:
        resized = F.interpolate(region, size=(size, size), mode="bilinear", antialias=True)[0]
    else:
        cl = torch.empty((1, 3, size, size), dtype=torch.uint8, memory_format=torch.channels_last)
        resized = _RESIZE_OUT(region, [size, size], False, None, None, out=cl)[0]
        if _pixels is not None and out is not None and out.is_contiguous():
            # interleaved -> planes (and the flip) in one pass: ~0.03 ms an image less at 224 px
            hwc = resized.permute(1, 2, 0).numpy()
            _pixels.to_planes(hwc, out.numpy(), size, size, flip)
            return out
    if flip:
        resized = resized.flip(-1)
    if out is None:
        return resized.contiguous()
    return out.copy_(resized)


def cover(image: Image.Image, hw: tuple[int, int]) -> Image.Image:
    """Resize so that the image just covers `hw`, keeping the centre `hw` window (draft mode)."""
    th, tw = hw
    w, h = image.size
    scale = max(tw / w, th / h)  # the scale at which the image just covers the target
    # JPEG draft (DCT scaling) to no less than the covering size: much less decoding work.
    drafted = image.draft("RGB", (max(1, round(w * scale)), max(1, round(h * scale))))
    rgb = image.convert("RGB")
    # The image spans draft's extent (w / k, h / k) of the decoded pixels (`pillow_path.crop_resize`).
    ew, eh = drafted[1][2:] if drafted is not None else rgb.size
    box = cover_box((ew, eh), rgb.size, hw)
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.Resampling.BILINEAR, box=box)
    return rgb


def cover_box(
    extent: tuple[float, float], pixels: tuple[int, int], hw: tuple[int, int]
) -> tuple[float, float, float, float]:
    """The sub-pixel window (left, top, right, bottom) of an image that, resized to `hw`, just
    covers it with the centre kept: what `cover` resizes (the dali backend hands it to DALI).

    Args:
        extent: the image's (width, height) in the decoded pixels (a DCT-scaled decode's extent).
        pixels: the decoded image's (width, height) in pixels (the box is clamped to it).
        hw: the output (height, width).
    """
    th, tw = hw
    ew, eh = extent
    scale = max(tw / ew, th / eh)
    half_w, half_h = tw / scale / 2, th / scale / 2
    # Clamped: tw / (tw / ew) can exceed ew by an ulp (one image size in 20: 103 x 103 to
    # 256 x 256), and Pillow refuses a box beyond the image ("box offset can't be negative").
    return (
        max(0.0, ew / 2 - half_w),
        max(0.0, eh / 2 - half_h),
        min(float(pixels[0]), ew / 2 + half_w),
        min(float(pixels[1]), eh / 2 + half_h),
    )
