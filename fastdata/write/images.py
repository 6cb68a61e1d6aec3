"""Open any image file a standard Pillow opens, and bring it to 8-bit RGB, at shard time.

The Pillow-SIMD built for the loaders lacks some codecs a standard Pillow has (WebP, compressed
TIFF, JPEG 2000; see `PIL.features.pilinfo()`). A file Pillow cannot decode is decoded here with
`imagecodecs` (a maintained collection of codec bindings: libwebp, libtiff, OpenJPEG, libavif,
libjpeg-turbo 3, with wheels for Linux, macOS and Windows, depending on numpy only). The shard
writer then stores it as lossless 8-bit RGB PNG, which every backend reads, so no reader needs
the extra codecs.

How a decoded image becomes 8-bit RGB (`to_rgb`):

- 16-bit (and 32-bit int) samples are scaled, `v * 255 / 65535` rounded, not clipped: Pillow's
  own `convert("RGB")` clips a 16-bit grey image to 255 and turns it white. Float samples are read
  as 0..1 (the TIFF convention) and clipped.
- Transparency (alpha channels, palette or colour-key `transparency`) is composited over
  `ALPHA_BACKGROUND` (white). Dropping alpha would show whatever the file stores under transparent
  pixels, often black and sometimes left-overs of editing; over white the image looks as it does
  in a viewer or on a web page.
- CMYK is converted by Pillow's formula (no ICC colour management: this Pillow has no LittleCMS).
- An animated image (GIF, WebP, APNG) gives its first frame; a multi-page TIFF its first page.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from fastdata.write.diagnose import describe_truncation, not_an_image, sniff_format

__all__ = [
    "ALPHA_BACKGROUND",
    "CODEC_PACKAGE",
    "FALLBACK_FORMATS",
    "OpenedImage",
    "UnreadableImage",
    "clean_message",
    "header_size",
    "open_image",
    "to_rgb",
]

ALPHA_BACKGROUND = (255, 255, 255)
CODEC_PACKAGE = "imagecodecs"
#: Formats decoded with imagecodecs when Pillow cannot: sniffed format -> imagecodecs function.
FALLBACK_FORMATS: dict[str, str] = {
    "WebP": "webp_decode",
    "TIFF": "tiff_decode",
    "JPEG 2000": "jpeg2k_decode",
    "AVIF": "avif_decode",
    # 12-bit and lossless JPEG: libjpeg-turbo 2 in Pillow reads neither; imagecodecs' 3.x does.
    "JPEG": "jpeg8_decode",
}
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


class UnreadableImage(ValueError):
    """The bytes are not an image this library can decode; `reason` says why, for a person."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class OpenedImage:
    """A fully decoded image.

    Args:
        image: the decoded image, in its own mode (bring it to RGB with `to_rgb`).
        format: the container: Pillow's format name ("JPEG", "MPO", "PNG", ...), or the sniffed
            name when imagecodecs decoded it ("WebP", "TIFF", "JPEG 2000", "AVIF", "JPEG").
        by_pillow: True when Pillow decoded it (the cpu and memory backends can read the bytes).
    """

    image: Image.Image
    format: str
    by_pillow: bool


def open_image(data: bytes) -> OpenedImage:
    """Decode every byte of an image file (truncation shows only on a full decode).

    Raises:
        UnreadableImage: the file is empty, not an image, truncated, or of a format that neither
            Pillow nor imagecodecs (if installed) decodes; the reason says which and what to do.
    """
    if not data:
        raise UnreadableImage("empty file")
    try:
        return _open_with_pillow(data)
    except Exception as exc:  # Pillow raises OSError, SyntaxError, struct.error... for bad files
        pillow_error = exc
    fmt = sniff_format(data)
    if fmt is None:
        raise UnreadableImage(not_an_image(data)) from pillow_error
    truncation = describe_truncation(fmt, data)
    if truncation is not None:
        raise UnreadableImage(f"truncated {fmt}: {truncation}") from pillow_error
    if isinstance(pillow_error, Image.DecompressionBombError):
        raise UnreadableImage(
            f"{fmt}: {clean_message(pillow_error)} If the file is trusted, raise "
            "PIL.Image.MAX_IMAGE_PIXELS before sharding, or shrink the image"
        ) from pillow_error
    if fmt in FALLBACK_FORMATS:
        return OpenedImage(_open_with_codecs(fmt, data), fmt, by_pillow=False)
    raise UnreadableImage(f"{fmt}: cannot decode ({clean_message(pillow_error)})") from pillow_error


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) read from the image's header without decoding its pixels; None when
    the header cannot be read here (decoding then says why the file is bad).

    Raises:
        UnreadableImage: the header is larger than Pillow's decompression-bomb limit.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning, missing WebP support
            with Image.open(io.BytesIO(data)) as image:  # lazy: reads the header only
                return int(image.width), int(image.height)
    except Image.DecompressionBombError as exc:
        raise UnreadableImage(
            f"{clean_message(exc)}: refused before decoding; shrink the image, or raise "
            "PIL.Image.MAX_IMAGE_PIXELS and max_pixels if it is trusted"
        ) from exc
    except Exception:  # not a format Pillow identifies (WebP in this build): read the header
        return webp_size(data) if sniff_format(data) == "WebP" else None


def webp_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a WebP file from its first chunk (VP8X, VP8L or VP8), or None."""
    kind, body = data[12:16], data[20:]
    if kind == b"VP8X" and len(body) >= 10:
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if kind == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if kind == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        return (
            int.from_bytes(body[6:8], "little") & 0x3FFF,
            int.from_bytes(body[8:10], "little") & 0x3FFF,
        )
    return None


def _open_with_pillow(data: bytes) -> OpenedImage:
    with warnings.catch_warnings():
        # "image file could not be identified because WEBP support not installed": we say it
        # better (and decode it) below.
        warnings.simplefilter("ignore", UserWarning)
        image = Image.open(io.BytesIO(data))
    image.load()
    return OpenedImage(image, image.format or "?", by_pillow=True)


def _open_with_codecs(fmt: str, data: bytes) -> Image.Image:
    try:
        import imagecodecs
    except ImportError as exc:
        raise UnreadableImage(
            f"{fmt}: no decoder in this Pillow build; install {CODEC_PACKAGE} "
            f"(pip install {CODEC_PACKAGE}) and shard again"
        ) from exc
    decode: Callable[..., Any] = getattr(imagecodecs, FALLBACK_FORMATS[fmt])
    try:
        pixels = decode(data) if fmt != "TIFF" else decode(data, index=0)
    except Exception as exc:  # imagecodecs raises its own *Error per codec, and ValueError
        raise UnreadableImage(f"{fmt}: cannot decode ({clean_message(exc)})") from exc
    return array_to_image(np.asarray(pixels), fmt)


def array_to_image(pixels: np.ndarray, fmt: str = "image") -> Image.Image:
    """An H x W (x C) array of any integer or float type -> an 8-bit L, LA, RGB or RGBA image."""
    if pixels.ndim == 3 and pixels.shape[-1] > 4 and pixels.shape[0] <= 4:
        pixels = np.moveaxis(pixels, 0, -1)  # planar (C, H, W) -> (H, W, C)
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    channels = 1 if pixels.ndim == 2 else pixels.shape[-1]
    modes = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}
    if pixels.ndim not in (2, 3) or channels not in modes:
        raise UnreadableImage(
            f"{fmt}: unsupported pixel layout {pixels.shape} {pixels.dtype}; "
            "convert it to RGB in an image editor first"
        )
    return Image.fromarray(np.ascontiguousarray(to_uint8(pixels)), modes[channels])


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Scale samples to 0..255: integers by their type's range, floats as 0..1 (clipped)."""
    if pixels.dtype == np.uint8:
        return pixels
    if pixels.dtype == np.bool_:
        return pixels.astype(np.uint8) * 255
    if pixels.dtype.kind == "f":
        return (np.clip(pixels, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if pixels.dtype.kind in "ui":
        top = min(np.iinfo(pixels.dtype).max, 65535)  # 32-bit ints hold 16-bit data in Pillow
        clipped = np.clip(pixels, 0, top).astype(np.uint64)
        return ((clipped * 255 + top // 2) // top).astype(np.uint8)
    raise UnreadableImage(f"unsupported sample type {pixels.dtype}")


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as 8-bit RGB (see the module docstring for the rules)."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        return array_to_image(np.asarray(image)).convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    try:
        return image.convert("RGB")
    except ValueError as exc:  # e.g. LAB: Pillow converts it only through ImageCms
        raise UnreadableImage(
            f"{image.format or 'image'} in {image.mode} colour: no conversion to RGB here "
            f"({clean_message(exc)}); convert the file to RGB first"
        ) from exc


def clean_message(exc: BaseException) -> str:
    """An exception's message without object reprs such as `<_io.BytesIO object at 0x7f...>`."""
    text = _OBJECT_REPR.sub("the file", str(exc)).strip()
    return text or type(exc).__name__
