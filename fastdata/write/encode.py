"""Sample encoding: how one source item becomes the image component of a shard sample.

Encodings (the `--encoding` choice):

| encoding | array sources (CIFAR)           | file sources (folders, lists)                          |
|----------|---------------------------------|--------------------------------------------------------|
| "auto"   | "raw"                           | "keep" (or "jpeg" when `resize` is given)              |
| "raw"    | `rgb`: the uint8 HWC bytes      | not allowed (images differ in size)                    |
| "png"    | `png`, lossless                 | decoded, converted to RGB, `png`                       |
| "jpeg"   | `jpg` at `quality`              | decoded, optionally resized, re-encoded `jpg`          |
| "keep"   | not allowed                     | JPEG bytes kept byte-identical; other formats -> `png` |

Every image file a standard Pillow opens is accepted (`fastdata.write.images`): formats this
Pillow-SIMD cannot decode (WebP, compressed TIFF, JPEG 2000, AVIF, 12-bit or lossless JPEG) are
decoded with imagecodecs and stored as PNG; 16-bit, palette, alpha and CMYK images become 8-bit RGB
by the rules documented there. JPEG bytes that Pillow decodes are kept under "keep" whatever their
mode (grey, CMYK, progressive, MPO): DALI's CPU decoder and Pillow read them to the same pixels.

Why "raw" for small images: a 32x32 CIFAR sample is 3,072 bytes raw and 2,277 as PNG, but decoding
the PNG costs 162 us of CPU against 1 us for a reshape, and the loader's CPU is the bottleneck the
library exists to remove (measured by benchmarks/bench_shard.py; the figures are in docs/results).
Every file sample is fully decoded once at shard time, so a corrupt or truncated image is found
here, not in the middle of a training run.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass

import numpy as np
from PIL import Image

from fastdata.write.images import UnreadableImage, header_size, open_image, to_rgb
from fastdata.write.sources.base import SourceItem

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "ENCODINGS",
    "BadSampleError",
    "EncodedSample",
    "encode_item",
    "read_source_file",
    "resolve_encoding",
    "shrink",
]

#: Most pixels (width x height) of an image file, checked from its header before it is decoded:
#: 64 megapixels (8000 x 8000) decode to ~190 MB of RGB; a 10000 x 10000 PNG took 1.1 GB of a
#: writer's memory. Photos of current phones and cameras are 12-50 megapixels.
DEFAULT_MAX_PIXELS = 64_000_000
# A file larger than this many bytes per allowed pixel is refused unread (uncompressed 16-bit RGBA
# TIFF is 8 bytes a pixel).
_MAX_BYTES_PER_PIXEL = 8

ENCODINGS = ("auto", "raw", "png", "jpeg", "keep")
# Containers whose bytes "keep" stores as they are (MPO: a phone's JPEG with a second picture
# appended; every decoder reads the first).
KEPT_FORMATS = ("JPEG", "MPO")
# PNG level 1: writes ~5x faster than the default 6 for ~10% more bytes; decode cost is the same.
PNG_COMPRESS_LEVEL = 1


class BadSampleError(ValueError):
    """One source sample cannot be read or decoded. `origin` names the file or archive row."""

    def __init__(self, origin: str, reason: str) -> None:
        super().__init__(f"{origin}: {reason}")
        self.origin = origin
        self.reason = reason


@dataclass(frozen=True)
class EncodedSample:
    """The image component of a sample: its extension, bytes and stored (height, width)."""

    ext: str
    data: bytes
    height: int
    width: int


def resolve_encoding(encoding: str, array_source: bool, resize: int | None) -> str:
    """The concrete encoding for "auto", or a ValueError for a combination that cannot work."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    if encoding == "auto":
        if array_source:
            return "raw" if resize is None else "png"
        return "keep" if resize is None else "jpeg"
    if encoding == "raw" and not array_source:
        raise ValueError(
            "encoding 'raw' needs images of one size (array sources such as CIFAR); "
            "use 'keep', 'png' or 'jpeg' for image files"
        )
    if encoding == "keep" and array_source:
        raise ValueError(
            "encoding 'keep' keeps image files as they are; arrays have no file: use 'raw' or 'png'"
        )
    if encoding == "raw" and resize is not None:
        raise ValueError("--resize cannot be combined with encoding 'raw'")
    return encoding


def encode_item(
    item: SourceItem,
    encoding: str,
    resize: int | None = None,
    quality: int = 90,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> EncodedSample:
    """Encode one source item with a concrete encoding (see `resolve_encoding`).

    Args:
        item: the source item (pixels, a file's bytes or a file).
        encoding: a concrete encoding.
        resize: shrink the shorter side to this many pixels.
        quality: JPEG quality when re-encoding.
        max_pixels: most width x height of an image file, checked from its header before
            decoding (None: no bound).

    Raises:
        BadSampleError: the item's file is missing, unreadable, truncated, not an image, or
            larger than `max_pixels`.
    """
    if item.pixels is not None:
        return _encode_pixels(item.pixels, encoding, resize, quality)
    if item.data is not None:
        data = item.data
        if max_pixels is not None and len(data) > _MAX_BYTES_PER_PIXEL * max_pixels:
            raise BadSampleError(
                item.origin,
                f"image is {len(data):,} bytes, more than an image of max_pixels={max_pixels:,} "
                "takes (raise --max-pixels if it is trusted)",
            )
    elif item.path is None:
        raise BadSampleError(
            item.origin, "the source gives no image here (no pixels, bytes or file)"
        )
    else:
        data = _read_image_file(item, max_pixels)
    try:
        _check_size(data, max_pixels)
        opened = open_image(data)
        rgb = to_rgb(opened.image)
    except UnreadableImage as exc:
        raise BadSampleError(item.origin, exc.reason) from exc
    if encoding == "keep" and opened.by_pillow and opened.format in KEPT_FORMATS:
        return EncodedSample("jpg", data, rgb.height, rgb.width)
    if resize is not None:
        rgb = shrink(rgb, resize)
    if encoding == "jpeg":
        return EncodedSample("jpg", _save(rgb, "JPEG", quality=quality), rgb.height, rgb.width)
    # "keep" for a non-JPEG file, and "png": lossless PNG.
    return EncodedSample(
        "png", _save(rgb, "PNG", compress_level=PNG_COMPRESS_LEVEL), rgb.height, rgb.width
    )


def _read_image_file(item: SourceItem, max_pixels: int | None) -> bytes:
    """The bytes of the item's image file, no larger than any image of `max_pixels` pixels
    could reasonably be."""
    if max_pixels is None:
        return read_source_file(item, None)
    hint = (
        f"more than an image of max_pixels={max_pixels:,} takes "
        "(raise --max-pixels if it is trusted)"
    )
    return read_source_file(item, _MAX_BYTES_PER_PIXEL * max_pixels, hint)


def read_source_file(item: SourceItem, max_bytes: int | None, hint: str = "") -> bytes:
    """The bytes of the item's file: a regular file (a FIFO would block, /dev/zero never end)
    of at most `max_bytes` bytes (None: no bound; `hint` says which limit, for the message).

    Raises:
        BadSampleError: missing, unreadable, not a regular file, or too large.
    """
    assert item.path is not None
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (no effect on regular files).
        fd = os.open(item.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BadSampleError(item.origin, "not a regular file (a folder, device or FIFO)")
            if max_bytes is not None and st.st_size > max_bytes:
                raise BadSampleError(
                    item.origin, f"file is {st.st_size:,} bytes, {hint or f'over {max_bytes:,}'}"
                )
            return f.read()
    except BadSampleError:
        raise
    except OSError as exc:
        raise BadSampleError(item.origin, f"cannot read file ({exc.strerror or exc})") from exc
    except ValueError as exc:  # a NUL in the path
        raise BadSampleError(item.origin, f"not a file name ({exc})") from exc


def _check_size(data: bytes, max_pixels: int | None) -> None:
    """Refuse an image whose header says it is larger than `max_pixels` (before decoding)."""
    if max_pixels is None:
        return
    size = header_size(data)
    if size is not None and size[0] * size[1] > max_pixels:
        width, height = size
        raise UnreadableImage(
            f"image is {width} x {height} = {width * height / 1e6:.1f} megapixels, more than "
            f"max_pixels={max_pixels:,} (read from its header; not decoded); shrink it, or raise "
            "--max-pixels if the file is trusted"
        )


def _encode_pixels(
    pixels: np.ndarray, encoding: str, resize: int | None, quality: int
) -> EncodedSample:
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    if encoding == "raw":
        return EncodedSample(
            "rgb", np.ascontiguousarray(pixels, dtype=np.uint8).tobytes(), height, width
        )
    image = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), "RGB")
    if resize is not None:
        image = shrink(image, resize)
    if encoding == "jpeg":
        return EncodedSample(
            "jpg", _save(image, "JPEG", quality=quality), image.height, image.width
        )
    return EncodedSample(
        "png", _save(image, "PNG", compress_level=PNG_COMPRESS_LEVEL), image.height, image.width
    )


def shrink(image: Image.Image, side: int, longer: bool = False) -> Image.Image:
    """`image` with its shorter side (or its `longer` one) at most `side` pixels: never
    enlarged, aspect kept, Pillow-SIMD bicubic with a reducing gap (antialiased). The one resize
    of the writer: `ShardOptions.resize` (shorter side) and `max_side` (longer side) use it."""
    limit = max(image.size) if longer else min(image.size)
    if limit <= side:
        return image
    scale = side / limit
    new = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(new, Image.BICUBIC, reducing_gap=3.0)


def _save(image: Image.Image, fmt: str, **params: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()
