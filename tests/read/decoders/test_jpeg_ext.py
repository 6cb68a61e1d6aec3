"""fastdata's JPEG region extension (fastdata/read/_jpeg.c) against a full Pillow decode.

Exact equality: the extension and Pillow-SIMD both run libjpeg-turbo with the islow IDCT and fancy
chroma upsampling, so a region is the full decode's crop, byte for byte, whatever the box, the
chroma subsampling, the scan type or the restart interval. Broken input makes it return False
(the caller then lets Pillow raise with the reason), never a half-decoded box.
"""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from fastdata.read.decoders import image as decode
from fastdata.read.decoders import jpeg_region
from fastdata.read.decoders.image import Geometry, decode_image
from tests.read.decoders.test_decode import encode as jpeg
from tests.read.decoders.test_decode import photo

_jpeg = pytest.importorskip(
    "fastdata.read._jpeg", reason="the extension was not built (no C compiler or libjpeg headers)"
)


def full(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def region(data: bytes, box: tuple[int, int, int, int]) -> np.ndarray | None:
    left, top, right, bottom = box
    out = np.full((bottom - top, right - left, 3), 7, dtype=np.uint8)
    return out if _jpeg.region(data, left, top, right - left, bottom - top, out) else None


def boxes(w: int, h: int, rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    """Random boxes plus the whole image, one pixel, and boxes against each edge."""
    found = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, w, h), (0, h // 2, w, h), (w // 3, 0, w, 1)]
    for _ in range(n):
        left, top = int(rng.integers(0, w)), int(rng.integers(0, h))
        found.append(
            (left, top, int(rng.integers(left + 1, w + 1)), int(rng.integers(top + 1, h + 1)))
        )
    return found


@pytest.mark.parametrize(
    "size, options",
    [
        ((533, 400), {"quality": 90, "subsampling": 2}),  # 4:2:0, clothing-small's shape
        ((533, 400), {"quality": 90, "subsampling": 1}),  # 4:2:2
        ((533, 400), {"quality": 95, "subsampling": 0}),  # 4:4:4
        ((97, 131), {"quality": 80, "progressive": True}),
        ((97, 131), {"quality": 85, "restart_marker_rows": 1}),
        ((1, 1), {}),
        ((13, 7), {"subsampling": 2}),
        ((9, 17), {"subsampling": 1}),
    ],
    ids=["420", "422", "444", "progressive", "restarts", "1x1", "13x7", "9x17"],
)
def test_regions_equal_the_full_decode_crop(size, options):
    h, w = size
    data = jpeg(photo(h, w, seed=h * w), **options)
    want = full(data)
    assert _jpeg.info(data) == (w, h, 3)
    for box in boxes(w, h, np.random.default_rng(h + w), 25):
        got = region(data, box)
        assert got is not None, box
        left, top, right, bottom = box
        assert np.array_equal(got, want[top:bottom, left:right]), box


def test_grayscale_is_decoded_to_rgb():
    data = jpeg(photo(45, 61)[..., 1])
    assert _jpeg.info(data) == (61, 45, 1)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(region(data, (5, 3, 40, 44)), want[3:44, 5:40])


def test_what_it_does_not_take():
    cmyk = io.BytesIO()
    Image.fromarray(photo(16, 16)).convert("CMYK").save(cmyk, "JPEG")
    png = io.BytesIO()
    Image.fromarray(photo(16, 16)).save(png, "PNG")
    for data in (cmyk.getvalue(), png.getvalue(), b"", b"\xff\xd8", b"\xff\xd8\xff\xe0garbage"):
        assert _jpeg.info(data) is None
        assert _jpeg.region(data, 0, 0, 1, 1, np.empty(3, np.uint8)) is False


def test_bad_boxes_and_buffers():
    data = jpeg(photo(20, 30))
    assert region(data, (0, 0, 31, 20)) is None  # past the right edge
    assert region(data, (0, 15, 30, 21)) is None  # past the bottom
    assert _jpeg.region(data, 0, 0, 0, 5, np.empty(3, np.uint8)) is False  # empty box
    with pytest.raises(ValueError, match=">= 300 bytes"):
        _jpeg.region(data, 0, 0, 10, 10, np.empty(299, np.uint8))
    with pytest.raises(TypeError, match="read-write bytes-like"):  # not contiguous
        _jpeg.region(data, 0, 0, 2, 2, np.empty((4, 8), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="read-write bytes-like"):
        _jpeg.region(data, 0, 0, 2, 2, b"read-only bytes are not writable")
    with pytest.raises(ValueError, match="out of JPEG range"):
        _jpeg.region(data, 70000, 0, 2, 2, np.empty(12, np.uint8))
    with pytest.raises(ValueError, match="out of JPEG range"):
        _jpeg.region(data, -1, 0, 2, 2, np.empty(12, np.uint8))
    for wraps in (2**64 + 5, -(2**64) + 5):  # once read as unsigned long: wrapped to 5
        with pytest.raises(OverflowError):
            _jpeg.region(data, wraps, 0, 2, 2, np.empty(12, np.uint8))


def test_corrupt_rows_inside_the_box_fail():
    data = bytearray(jpeg(photo(160, 160), quality=90))
    sos = data.rfind(b"\xff\xda")
    scan = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    at = scan + (len(data) - scan) * 3 // 4  # in the last quarter of the rows
    data[at : at + 2] = b"\xff\xd9"  # an end-of-image marker inside the scan
    assert region(bytes(data), (0, 0, 160, 160)) is None  # libjpeg warns: not returned
    assert region(bytes(data), (0, 0, 160, 1)) is not None  # rows before the damage decode


def test_a_truncated_file_takes_pillows_path_and_says_so():
    whole = jpeg(photo(200, 120), quality=90)
    truncated = whole[: len(whole) * 2 // 3]
    # libjpeg would pad the missing rows grey; the extension reports failure instead.
    assert region(truncated, (0, 0, 120, 200)) is None
    with pytest.raises(ValueError, match="truncated"):
        decode_image(truncated, Geometry("center", size=64), np.random.default_rng(0))


def test_the_rows_below_the_box_are_not_read():
    """The decode stops at the box's last row: bytes past it are never entropy-decoded."""
    data = bytearray(jpeg(photo(256, 64), quality=90, subsampling=0))
    want = full(bytes(data))
    eoi = len(data) - 2
    data[eoi - 200 : eoi] = bytes(200)  # the last rows' entropy data, zeroed
    assert np.array_equal(region(bytes(data), (0, 0, 64, 16)), want[:16])
    assert region(bytes(data), (0, 0, 64, 256)) is None or not np.array_equal(
        region(bytes(data), (0, 0, 64, 256)), want
    )


def test_threads_decode_at_once_and_agree():
    datas = [jpeg(photo(300, 200, seed=i), quality=85) for i in range(8)]
    wants = [full(d)[10:290, 20:180] for d in datas]
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(5):
            for d, want in zip(datas[k::2], wants[k::2], strict=True):
                if not np.array_equal(region(d, (20, 10, 180, 290)), want):
                    errors.append(f"thread {k}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_memoryview_of_a_shard_is_accepted():
    data = jpeg(photo(40, 40))
    padded = memoryview(b"xx" + data + b"yy")[2:-2]
    assert np.array_equal(region(padded, (3, 4, 30, 33)), full(data)[4:33, 3:30])


def test_the_decoder_choice(monkeypatch):
    monkeypatch.setenv(jpeg_region.DECODER_ENV, "libjpeg")
    assert jpeg_region.region_decoder().name.startswith("fastdata._jpeg (libjpeg-turbo ")
    assert decode.jpeg_region_decoder().startswith("fastdata._jpeg")
    monkeypatch.setenv(jpeg_region.DECODER_ENV, "pillow")
    assert jpeg_region.region_decoder() is None
    monkeypatch.setenv(jpeg_region.DECODER_ENV, "auto")
    assert isinstance(jpeg_region.region_decoder(), jpeg_region.LibjpegDecoder)
    monkeypatch.setenv(jpeg_region.DECODER_ENV, "turbo")
    with pytest.raises(jpeg_region.DecoderChoiceError, match="auto, libjpeg, pillow"):
        jpeg_region.region_decoder()
    # A setting to fix, not a bad image: never a ValueError, which readers skip under
    # on_error="skip" (every JPEG of the epoch would have been skipped).
    data, rngs = jpeg(photo(40, 40)), [np.random.default_rng(0)]
    geometry = decode.Geometry("rrc", size=16, scale=(0.08, 1.0), ratio=(0.75, 4 / 3))
    with pytest.raises(jpeg_region.DecoderChoiceError):
        decode.decode_image(data, geometry, rngs[0])
    with pytest.raises(jpeg_region.DecoderChoiceError):
        decode.decode_batch([data], geometry, rngs, 1)


def test_progressive_with_unrefined_scans_equals_the_full_decode():
    """A progressive JPEG whose scans stop at DC (libjpeg then smooths across blocks): its
    regions equal the full decode's (a column crop there gave up to 49 levels off)."""
    data = jpeg(photo(64, 96, seed=5), quality=90, progressive=True)
    first = data.find(b"\xff\xda")
    second = data.find(b"\xff\xda", first + 2)
    table = data.rfind(b"\xff\xc4", first, second)
    dc_only = data[: table if table > 0 else second] + b"\xff\xd9"
    want = full(dc_only)
    for left in range(0, 90, 3):
        got = region(dc_only, (left, 0, left + 6, 64))
        assert got is not None and np.array_equal(got, want[:, left : left + 6]), left
