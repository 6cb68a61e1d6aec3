"""`jpeg_size` reads the stored size from the frame header, for every JPEG flavour, or says None."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fastdata.read.decoders.jpeg_header import jpeg_size


def _jpeg(w: int, h: int, **save) -> bytes:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, "JPEG", **save)
    return out.getvalue()


@pytest.mark.parametrize(
    "save",
    [
        {},
        {"progressive": True},
        {"optimize": True, "quality": 40},
        {"subsampling": 0},
        {"exif": Image.Exif().tobytes() + b"\0" * 4000},  # an APP1 segment before the frame
        {"icc_profile": b"\0" * 70_000},  # APP2 segments spanning several markers
    ],
)
def test_size_of_each_flavour_matches_pillow(save):
    data = _jpeg(37, 23, **save)
    assert jpeg_size(data) == (23, 37)
    assert jpeg_size(memoryview(data)) == (23, 37)


def test_grayscale_and_large_sizes():
    image = Image.new("L", (4000, 3), 128)
    out = io.BytesIO()
    image.save(out, "JPEG")
    assert jpeg_size(out.getvalue()) == (3, 4000)


def test_not_a_jpeg_or_cut_before_the_frame_is_none():
    data = _jpeg(16, 8, icc_profile=b"\0" * 2000)
    frame = data.index(b"\xff\xc0")
    assert jpeg_size(data[:frame]) is None  # truncated in the APP segments
    assert jpeg_size(data[: frame + 6]) is None  # inside the frame header
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    assert jpeg_size(png.getvalue()) is None
    assert jpeg_size(b"") is None and jpeg_size(b"\xff\xd8\x00\x00") is None
