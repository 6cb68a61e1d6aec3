"""A folder of every image kind a standard Pillow opens, plus broken files, made from pixels.

Pillow-SIMD here writes neither WebP nor compressed TIFF, so those are written with imagecodecs
(and the animated WebP container by hand). Each entry keeps the pixels it was made from, so a
test can compare what the shards hold with what the file shows.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import imagecodecs
import numpy as np
from PIL import Image

__all__ = ["BROKEN", "ZooImage", "make_zoo", "valid_images", "webp_animation"]

_RNG = np.random.default_rng(7)


@dataclass(frozen=True)
class ZooImage:
    """A file of the zoo: its name, bytes, and the RGB pixels it should become (None: unknown)."""

    name: str
    data: bytes
    expected: np.ndarray | None = None
    kept: bool = False  # JPEG bytes stored as they are


def _pixels(h: int = 24, w: int = 30, c: int = 3, dtype=np.uint8) -> np.ndarray:
    top = np.iinfo(dtype).max
    return _RNG.integers(0, int(top) + 1, (h, w, c) if c else (h, w), dtype=dtype)


def _pil(image: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def webp_animation(frames: list[np.ndarray]) -> bytes:
    """An animated WebP of lossless RGB frames (VP8X + ANIM + one ANMF chunk per frame)."""

    def chunk(tag: bytes, payload: bytes) -> bytes:
        return tag + struct.pack("<I", len(payload)) + payload + b"\x00" * (len(payload) & 1)

    def u24(v: int) -> bytes:
        return v.to_bytes(3, "little")

    h, w = frames[0].shape[:2]
    body = chunk(b"VP8X", bytes([0x02, 0, 0, 0]) + u24(w - 1) + u24(h - 1))
    body += chunk(b"ANIM", b"\xff\xff\xff\xff" + b"\x00\x00")
    for frame in frames:
        still = imagecodecs.webp_encode(frame, lossless=True)
        bitstream = still[12:]  # the still image's VP8L chunk, after "RIFF<size>WEBP"
        header = u24(0) + u24(0) + u24(w - 1) + u24(h - 1) + u24(100) + bytes([0x02])
        body += chunk(b"ANMF", header + bitstream)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def _scaled16(pixels16: np.ndarray) -> np.ndarray:
    return ((pixels16.astype(np.uint64) * 255 + 32767) // 65535).astype(np.uint8)


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[..., None] / 255.0
    return np.round(rgb * a + 255.0 * (1.0 - a)).astype(np.uint8)


def valid_images() -> list[ZooImage]:
    """One file per mode and container that must shard and load."""
    rgb = _pixels()
    grey = _pixels(c=0)
    rgba = _pixels(c=4)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255  # one fully transparent, one opaque pixel at least
    grey16 = _pixels(c=0, dtype=np.uint16)
    rgb16 = _pixels(dtype=np.uint16)
    palette = Image.fromarray(rgb).quantize(16)
    la = np.dstack([grey, _pixels(c=0)])
    frames = [_pixels(), _pixels()]
    big = np.repeat(np.repeat(_pixels(30, 40), 100, axis=0), 100, axis=1)  # 3000 x 4000: 12 MP
    rgba_over_white = _over_white(rgba[..., :3], rgba[..., 3])
    palette_rgba = np.asarray(palette.convert("RGB"))
    palette_over_white = np.where(
        (np.asarray(palette) == 0)[..., None], np.uint8(255), palette_rgba
    ).astype(np.uint8)
    anim_gif = [Image.fromarray(f).quantize(64) for f in frames]
    images = [
        ZooImage("rgb.jpg", _pil(Image.fromarray(rgb), "JPEG"), kept=True),
        ZooImage("UPPER.JPG", _pil(Image.fromarray(rgb), "JPEG", quality=70), kept=True),
        ZooImage("mixed.Jpeg", _pil(Image.fromarray(grey), "JPEG"), kept=True),
        ZooImage(
            "progressive.jpg", _pil(Image.fromarray(rgb), "JPEG", progressive=True), kept=True
        ),
        ZooImage("cmyk.jpg", _pil(Image.fromarray(rgb).convert("CMYK"), "JPEG"), kept=True),
        ZooImage("photo_12mp.jpg", _pil(Image.fromarray(big), "JPEG", quality=80), kept=True),
        ZooImage("one_pixel.jpg", _pil(Image.new("RGB", (1, 1), (200, 10, 10)), "JPEG"), kept=True),
        ZooImage("twelve_bit.jpg", imagecodecs.jpeg8_encode(rgb16 >> 4, bitspersample=12)),
        ZooImage("still.webp", imagecodecs.webp_encode(rgb, lossless=True), rgb),
        ZooImage("lossy.WEBP", imagecodecs.webp_encode(rgb, level=90)),
        ZooImage("alpha.webp", imagecodecs.webp_encode(rgba, lossless=True), rgba_over_white),
        ZooImage("animated.webp", webp_animation(frames), frames[0]),
        ZooImage("plain.tif", _pil(Image.fromarray(rgb), "TIFF"), rgb),
        ZooImage("lzw.tiff", imagecodecs.tiff_encode(rgb, compression="lzw"), rgb),
        ZooImage("deflate.TIF", imagecodecs.tiff_encode(rgb, compression="deflate"), rgb),
        ZooImage("jpeg_in.tif", imagecodecs.tiff_encode(rgb, compression="jpeg")),
        ZooImage("grey16.tif", imagecodecs.tiff_encode(grey16), _gray3(_scaled16(grey16))),
        ZooImage("rgb16_lzw.tif", imagecodecs.tiff_encode(rgb16, compression="lzw")),
        ZooImage("palette_trns.png", _pil(palette, "PNG", transparency=0), palette_over_white),
        ZooImage("grey16.png", _pil(Image.fromarray(grey16), "PNG"), _gray3(_scaled16(grey16))),
        ZooImage("rgb16.png", imagecodecs.png_encode(rgb16), _scaled16(rgb16)),
        ZooImage("grey_alpha.png", _pil(Image.fromarray(la, "LA"), "PNG"), _la_expected(la)),
        ZooImage("rgba.png", _pil(Image.fromarray(rgba), "PNG"), rgba_over_white),
        ZooImage(
            "one_pixel.png",
            _pil(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG"),
            np.array([[[1, 2, 3]]], np.uint8),
        ),
        ZooImage("still.gif", _pil(palette, "GIF")),
        ZooImage(
            "animated.gif", _pil(anim_gif[0], "GIF", save_all=True, append_images=anim_gif[1:])
        ),
        ZooImage("plain.bmp", _pil(Image.fromarray(rgb), "BMP"), rgb),
        ZooImage("pixels.jp2", imagecodecs.jpeg2k_encode(rgb, level=0), None),
        ZooImage("café_日本.png", _pil(Image.fromarray(rgb), "PNG"), rgb),
    ]
    return images


def _gray3(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[..., None], 3, axis=2)


def _la_expected(la: np.ndarray) -> np.ndarray:
    return _gray3(_over_white(la[..., :1], la[..., 1])[..., 0])


def _jpeg_cut(cut: int) -> bytes:
    return _pil(Image.fromarray(_pixels(40, 40)), "JPEG")[:-cut]


#: Broken files -> a phrase their reason must contain.
BROKEN: dict[str, tuple[bytes, str]] = {
    "empty.jpg": (b"", "empty file"),
    "notes.jpg": (
        b"this is not an image, just some notes\n",
        "not an image: starts with 'this is not",
    ),
    "cut.jpg": (_jpeg_cut(37), "truncated JPEG: the file stops after"),
    "cut.png": (
        _pil(Image.fromarray(_pixels()), "PNG")[:-37],
        "truncated PNG: at least 37 bytes missing",
    ),
    "cut.webp": (
        imagecodecs.webp_encode(_pixels(), lossless=True)[:-37],
        "truncated WebP: 37 bytes missing",
    ),
}


def make_zoo(root: Path) -> tuple[list[ZooImage], dict[str, str]]:
    """Write the zoo as a two-class folder (`root/a`, `root/b`); return valid files and broken ones."""
    images = valid_images()
    for i, image in enumerate(images):
        folder = root / ("a" if i % 2 == 0 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / image.name).write_bytes(image.data)
    for name, (data, _) in BROKEN.items():
        (root / "a" / name).write_bytes(data)
    return images, {name: phrase for name, (_, phrase) in BROKEN.items()}
