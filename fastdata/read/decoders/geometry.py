"""The decode-time geometry of an image: its output size, and the crop window and flip drawn for it.

`Geometry` is what a preset asks of decoding ("rrc", "center", "cover", "none"); `draw_crop`
draws one image's window and flip from it, the one draw every backend makes (the cpu backend's
decoders, nvjpeg on the GPU, DALI's feed); `stored_hw` is the size a split's photos are stored at
when no crop is fused into decoding. `fastdata.read.decoders.image` decodes with them and
re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdata.format.manifest import SplitInfo

__all__ = ["EVAL_RESIZE_RATIO", "Geometry", "draw_crop", "stored_hw"]


EVAL_RESIZE_RATIO = 256 / 224
_CROP_RATIO = (256, 224)  # stored side / output side for photos


def stored_hw(
    info: SplitInfo, image_size: int | tuple[int, int] | None, margin: bool = True
) -> tuple[int, int]:
    """(H, W) of a split's decoded images when no crop is fused at decode time.

    Raw samples, and encoded ones of one common size without `image_size`, keep their size.
    Encoded images with `image_size` S are resized to cover a centre square and cropped to it:
    with `margin` (the preset's ops crop to S themselves: `Preset.resizes`) the square is
    floor(S * 256 / 224) (256 for 224), the usual resize-256 / crop-224 ratio, so a device
    random-resized crop or centre crop of S has room; without, the square is S itself (the
    output size: "cifar", "none", user callables).

    Args:
        info: the split.
        image_size: the output side S (or (H, W)); None keeps the images' common size.
        margin: store room around S for a crop on the device.

    Raises:
        ValueError: for photos of varying size without an `image_size`.
    """
    if info.encoding == "raw" or (image_size is None and info.raw_shape is not None):
        if info.raw_shape is None:
            raise ValueError("a raw split must have a raw_shape in its manifest; re-run the writer")
        return int(info.raw_shape[0]), int(info.raw_shape[1])
    if image_size is None:
        raise ValueError(
            f"the split's {info.encoding} images vary in size "
            f"({info.image_stats or 'no stats'}): pass image_size (e.g. 224) to decode them to one size"
        )
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    if h <= 0 or w <= 0:
        raise ValueError(f"image_size must be positive, got {image_size!r}")
    if not margin:
        return h, w
    num, den = _CROP_RATIO  # floor: 224 -> 256, as ResizeCenterCrop's resize
    return h * num // den, w * num // den


@dataclass(frozen=True)
class Geometry:
    """Decode-time geometry.

    Args:
        kind: "none", "rrc", "center" or "cover".
        size: output side in pixels (square output) for "rrc" and "center".
        scale: area range of the random-resized crop.
        ratio: aspect-ratio range of the random-resized crop.
        flip_p: probability of a left-right flip of each image (drawn after the crop box).
        resize_ratio: "center": the shorter side is resized to ``size * resize_ratio``.
        hw: "cover": the output (H, W).
    """

    kind: str = "none"
    size: int = 0
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.0
    resize_ratio: float = EVAL_RESIZE_RATIO
    hw: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.kind not in ("none", "rrc", "center", "cover"):
            raise ValueError(
                f"geometry kind must be 'none', 'rrc', 'center' or 'cover', got {self.kind!r}"
            )
        if self.kind in ("rrc", "center") and self.size < 1:
            raise ValueError(f"geometry {self.kind!r} needs a positive size, got {self.size}")
        if self.kind == "cover" and min(self.hw) < 1:
            raise ValueError(f"geometry 'cover' needs a positive hw, got {self.hw}")
        if not 0.0 <= self.flip_p <= 1.0:
            raise ValueError(f"flip_p must be in [0, 1], got {self.flip_p}")

    @property
    def out_hw(self) -> tuple[int, int]:
        """(H, W) of every decoded image ((0, 0) for "none": the images' own size)."""
        if self.kind == "cover":
            return self.hw
        return (self.size, self.size)


def draw_crop(
    size: tuple[int, int], geometry: Geometry, rng: np.random.Generator
) -> tuple[tuple[int, int, int, int], bool]:
    """The crop window and flip of one image: the one geometry of every backend.

    The draws, in order: the box ("rrc": `fastdata.augment.rrc_params` from `rng`; "center": the
    centre box of `fastdata.augment.center_crop_box`; "cover": the centre window of the
    image's aspect ratio that covers `Geometry.hw`, rounded to whole pixels; "none": the whole
    image; only "rrc" draws), then the flip (one draw when ``flip_p > 0``). The cpu backend crops
    these windows (the Pillow path's "cover" resizes the same window at sub-pixel precision), the
    nvjpeg backend crops them on the GPU, and a backend that hands the windows to another library
    (DALI) takes them from here.

    Args:
        size: the image's (width, height) in stored (not EXIF-rotated) pixels, as Pillow's
            `Image.size`.
        geometry: the decode-time geometry.
        rng: the sample's generator (`fastdata.read.plan.sample_seed`).

    Returns:
        ((left, top, right, bottom) in full-resolution pixels, flip).
    """
    width, height = size
    if geometry.kind == "rrc":
        from fastdata.augment import rrc_params

        top, left, h, w = rrc_params(height, width, geometry.scale, geometry.ratio, rng)
    elif geometry.kind == "center":
        from fastdata.augment import center_crop_box

        top, left, h, w = center_crop_box(height, width, geometry.size, geometry.resize_ratio)
    elif geometry.kind == "cover":
        th, tw = geometry.hw
        scale = max(tw / width, th / height)  # the scale at which the image just covers hw
        h = min(height, max(1, round(th / scale)))
        w = min(width, max(1, round(tw / scale)))
        top, left = (height - h) // 2, (width - w) // 2
    else:
        top, left, h, w = 0, 0, height, width
    flip = geometry.flip_p > 0 and bool(rng.random() < geometry.flip_p)
    return (left, top, left + w, top + h), flip
