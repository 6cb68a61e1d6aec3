"""CPU decoding of one sample to uint8 HWC pixels: where a sample is decoded.

Raw samples (`rgb`) are a reshape. Encoded images (`jpg`, `png`) are decoded with Pillow-SIMD and
given their decode-time geometry here, because it is cheaper to shrink while decoding than after:

- "rrc" (training, photo preset): the random-resized-crop box is drawn first from the image's
  size, then JPEG draft mode asks libjpeg for the smallest DCT scale (1/2, 1/4, 1/8) that still
  covers the box at the output size, and one `resize(box=...)` crops and scales in one pass.
- "center" (evaluation): resize the shorter side to `size * 256 / 224` and take the centre
  `size` x `size` crop, again through draft mode and one boxed resize.
- "cover": resize so the image just covers `hw` and take the centre `hw` window (the stored size
  of photos when no crop is fused: `stored_hw`; the memory backend's store uses it too).
- "none": decode at the stored size (every image of the split must then share one size).

A preset's decode-time flip (`Geometry.flip_p`, "photo") is a PIL transpose after the resize.
Pad-crops, other flips and normalization happen later, batched on the device (fastdata.augment).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from fastdata.manifest import SplitInfo

__all__ = [
    "EVAL_RESIZE_RATIO",
    "Geometry",
    "decode_batch",
    "decode_image",
    "decode_raw",
    "stored_hw",
]

EVAL_RESIZE_RATIO = 256 / 224
_CROP_RATIO = (256, 224)  # stored side / output side for photos


def stored_hw(info: SplitInfo, image_size: int | tuple[int, int] | None) -> tuple[int, int]:
    """(H, W) of a split's decoded images when no crop is fused at decode time.

    Raw samples, and encoded ones of one common size without `image_size`, keep their size;
    photos with `image_size` S: the centre square at floor(S * 256 / 224) (256 for 224), the usual
    resize-256 / crop-224 ratio, so a device random-resized crop or centre crop of S has room.

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
    num, den = _CROP_RATIO  # floor, as fastdata.augment.center_crop_params: 224 -> 256
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


def decode_raw(data: memoryview | bytes, shape: tuple[int, int, int]) -> np.ndarray:
    """Raw HWC uint8 pixels (a view when possible). ValueError when the size does not match."""
    expected = shape[0] * shape[1] * shape[2]
    if len(data) != expected:
        raise ValueError(f"raw sample has {len(data)} bytes, expected {expected} for shape {shape}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def decode_image(
    data: memoryview | bytes, geometry: Geometry, rng: np.random.Generator
) -> np.ndarray:
    """Decode JPEG/PNG bytes to uint8 HWC RGB with the decode-time `geometry`.

    Raises:
        ValueError: the bytes are not a readable image (the caller adds the shard and key).
    """
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if geometry.kind == "none":
            return _to_array(_maybe_flip(image, geometry.flip_p, rng))
        if geometry.kind == "cover":
            return _to_array(_maybe_flip(_cover(image, geometry.hw), geometry.flip_p, rng))
        if geometry.kind == "rrc":
            from fastdata.augment import rrc_params

            top, left, h, w = rrc_params(height, width, geometry.scale, geometry.ratio, rng)
        else:
            side = min(width, height) / geometry.resize_ratio
            h = w = max(1, round(side))
            top, left = (height - h) // 2, (width - w) // 2
        image = _crop_resize(image, (left, top, left + w, top + h), geometry.size)
        return _to_array(_maybe_flip(image, geometry.flip_p, rng))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot decode image ({type(exc).__name__}: {exc})") from exc


def decode_batch(
    payloads: Sequence[memoryview | bytes],
    geometry: Geometry,
    rngs: Sequence[np.random.Generator],
    threads: int = 1,
) -> list[np.ndarray | ValueError]:
    """Decode a batch of encoded images: entry i is image i's HWC uint8 pixels, or its error.

    Each image draws its random geometry from its own generator `rngs[i]`, so the result does not
    depend on the order in which images are decoded (nor on `threads`).

    Args:
        payloads: encoded image bytes.
        geometry: the decode-time geometry of every image.
        rngs: one generator per image.
        threads: decode threads (1: in the calling thread).
    """
    if len(payloads) != len(rngs):
        raise ValueError(f"need one generator per image, got {len(payloads)} and {len(rngs)}")

    def one(i: int) -> np.ndarray | ValueError:
        try:
            return decode_image(payloads[i], geometry, rngs[i])
        except ValueError as exc:
            return exc

    return [one(i) for i in range(len(payloads))]


def _maybe_flip(image: Image.Image, flip_p: float, rng: np.random.Generator) -> Image.Image:
    """Mirror `image` left-right with probability `flip_p` (no draw when it is 0)."""
    if flip_p > 0 and rng.random() < flip_p:
        return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def _crop_resize(image: Image.Image, box: tuple[int, int, int, int], size: int) -> Image.Image:
    """Crop `box` (in full-resolution pixels) and resize it to size x size, via draft mode."""
    width, height = image.size
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    if image.format == "JPEG":
        # Ask for the smallest DCT scale at which the box still has >= `size` pixels per side.
        reduce = max(1.0, min(box_w / size, box_h / size))
        image.draft("RGB", (max(1, int(width / reduce)), max(1, int(height / reduce))))
    scale_x = image.size[0] / width
    scale_y = image.size[1] / height
    scaled = (box[0] * scale_x, box[1] * scale_y, box[2] * scale_x, box[3] * scale_y)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image.resize((size, size), Image.BILINEAR, box=scaled)


def _cover(image: Image.Image, hw: tuple[int, int]) -> Image.Image:
    """Resize so that the image just covers `hw`, keeping the centre `hw` window (draft mode)."""
    th, tw = hw
    w, h = image.size
    cover = max(tw / w, th / h)  # the scale at which the image just covers the target
    # JPEG draft (DCT scaling) to no less than the covering size: much less decoding work.
    image.draft("RGB", (max(1, round(w * cover)), max(1, round(h * cover))))
    rgb = image.convert("RGB")
    w, h = rgb.size
    cover = max(tw / w, th / h)
    box = ((w - tw / cover) / 2, (h - th / cover) / 2, (w + tw / cover) / 2, (h + th / cover) / 2)
    if (w, h) != (tw, th):
        rgb = rgb.resize((tw, th), Image.Resampling.BILINEAR, box=box)
    return rgb


def _to_array(image: Image.Image) -> np.ndarray:
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)
