"""The one CPU decoder (fastdata.read.decoders.image): region decoding, geometry, threads, errors, fork."""

from __future__ import annotations

import io
import multiprocessing as mp

import numpy as np
import pytest
from PIL import Image

from fastdata._util import threads as _threads
from fastdata.augment import rrc_params
from fastdata.read.decoders import image as decode
from fastdata.read.decoders import jpeg_region, pillow_path
from fastdata.read.decoders.image import Geometry, decode_batch, decode_image, jpeg_region_decoder

# Mean absolute difference (uint8 levels) allowed between a region decode and a full Pillow decode
# then `crop(box).resize(...)` of the same box (torchvision's `resized_crop` on a PIL image), over
# the whole crop and over each edge row / column. Both decoders are libjpeg-turbo with the same DCT
# (islow) and fancy chroma upsampling, and torch's uint8 antialiased bilinear kernel computes
# Pillow's weights, so the pixels are equal where both libraries take the same code paths
# (measured: 0.0 on these images and on 640 clothing-small photos). The bound leaves room for
# +-1 rounding differences between libjpeg-turbo builds (SIMD vs C IDCT) on a quarter of the
# pixels. Measured errors it catches: nvImageCodec's default box-filter chroma upsampling
# (0.35-0.71 on the 4:2:0 image), Pillow's `resize(box=...)`, whose filter reads beyond the box
# (worst edge line: median 0.73, up to 2.7 over 40 clothing-small crops), and a wrong box or
# axis (tens of levels).
REGION_MAD = 0.25
# The DCT-scaled path (draft mode, large boxes only) low-passes differently from a full-size
# bilinear resize: measured 0.42-0.45 on the 1600x1200 test photo below; a crop shifted by 3 px
# is ~20 off.
DCT_MAD = 1.5

needs_region_decoder = pytest.mark.skipif(
    jpeg_region_decoder() is None,
    reason="no JPEG region decoder: fastdata._jpeg not built",
)


@pytest.fixture(params=["libjpeg"])
def each_decoder(request, monkeypatch):
    """Run the test with each region decoder ($FASTDATA_REGION_DECODER); skip a missing one."""
    monkeypatch.setenv(jpeg_region.DECODER_ENV, request.param)
    if jpeg_region.region_decoder() is None:
        pytest.skip(f"the {request.param} region decoder is not available here")
    return request.param


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image: smooth colour gradients, hard-edged shapes and sensor noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 53 - c) for c in range(3)], -1)
    for _ in range(12):
        cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(8, max(9, h // 6))
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.integers(0, 256, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str = "JPEG", **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **kwargs)
    return buf.getvalue()


def reference(data: bytes, geometry: Geometry, seed: int) -> np.ndarray:
    """Full Pillow decode, then `crop(box).resize(...)` of the same box, then flip."""
    return box_and_reference(data, geometry, seed)[1]


def box_and_reference(
    data: bytes, geometry: Geometry, seed: int
) -> tuple[tuple[int, int, int, int], np.ndarray]:
    """(box, `reference`'s pixels): the box drawn with decode_image's draws."""
    rng = np.random.default_rng(seed)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    width, height = full.size
    if geometry.kind == "rrc":
        top, left, h, w = rrc_params(height, width, geometry.scale, geometry.ratio, rng)
    else:
        h = w = max(1, round(min(width, height) / geometry.resize_ratio))
        top, left = (height - h) // 2, (width - w) // 2
    box = (left, top, left + w, top + h)
    out = full.crop(box).resize((geometry.size,) * 2, Image.BILINEAR)
    if geometry.flip_p > 0 and rng.random() < geometry.flip_p:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return box, np.asarray(out)


def mad(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return float(np.abs(a.astype(np.int16) - b).mean())


def edge_mad(a: np.ndarray, b: np.ndarray) -> float:
    """The largest MAD of the four edge lines (where a boxed resize would read beyond the box)."""
    edges = (np.s_[0], np.s_[-1], np.s_[:, 0], np.s_[:, -1])
    return max(mad(np.ascontiguousarray(a[e]), np.ascontiguousarray(b[e])) for e in edges)


def pillow_path_forbidden(monkeypatch) -> None:
    """Make the Pillow crop path fail, so a passing decode proves the region path ran."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the Pillow path ran where the region decoder should have")

    monkeypatch.setattr(pillow_path, "crop_resize", forbidden)


@needs_region_decoder
@pytest.mark.parametrize("subsampling", [0, 2])  # 4:4:4 and 4:2:0 chroma
@pytest.mark.parametrize("kind", ["rrc", "center"])
def test_region_decode_matches_full_decode_then_crop(monkeypatch, each_decoder, subsampling, kind):
    data = encode(photo(533, 400), quality=90, subsampling=subsampling)
    geometry = Geometry(kind, size=224, flip_p=0.5 if kind == "rrc" else 0.0)
    pillow_path_forbidden(monkeypatch)
    for seed in range(12):
        got = decode_image(data, geometry, np.random.default_rng(seed))
        want = reference(data, geometry, seed)
        assert got.shape == (224, 224, 3)
        assert mad(got, want) <= REGION_MAD and edge_mad(got, want) <= REGION_MAD, seed


@needs_region_decoder
def test_region_decode_of_grayscale_and_small_crops(monkeypatch, each_decoder):
    gray = encode(photo(120, 90)[..., 0])  # mode "L": decoded to RGB by both paths
    geometry = Geometry("rrc", size=32, scale=(0.02, 0.1))
    pillow_path_forbidden(monkeypatch)
    for seed in range(6):
        got = decode_image(gray, geometry, np.random.default_rng(seed))
        assert mad(got, reference(gray, geometry, seed)) <= REGION_MAD, seed


@needs_region_decoder
def test_region_decode_ignores_exif_rotation_as_pillow_does(monkeypatch, each_decoder):
    exif = Image.Exif()
    # "Rotate 90 CW to display": Pillow does not apply it, and nvImageCodec applies it to whole
    # images by default (the decoder turns that off) but not to regions. Boxes and regions are in
    # stored coordinates on both paths.
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(photo(90, 150)).save(buf, "JPEG", exif=exif)
    data = buf.getvalue()
    geometry = Geometry("rrc", size=48, ratio=(0.5, 0.6))  # tall boxes: a swap would not fit
    pillow_path_forbidden(monkeypatch)
    for seed in range(4):
        got = decode_image(data, geometry, np.random.default_rng(seed))
        assert mad(got, reference(data, geometry, seed)) <= REGION_MAD, seed


@pytest.mark.realdata
@needs_region_decoder
def test_region_decode_matches_on_real_photos(real_data, monkeypatch, each_decoder):
    files = sorted((real_data / "clothing-small" / "train").glob("*/*.jpg"))[:24]
    assert files, "clothing-small/train has no JPEGs"
    geometry = Geometry("rrc", size=224, flip_p=0.5)
    pillow_path_forbidden(monkeypatch)
    for seed, path in enumerate(files):
        data = path.read_bytes()
        got = decode_image(data, geometry, np.random.default_rng(seed))
        want = reference(data, geometry, seed)
        assert mad(got, want) <= REGION_MAD and edge_mad(got, want) <= REGION_MAD, path.name


def test_large_boxes_use_dct_scaling(monkeypatch):
    """A box that a 1/2+ DCT scale still covers is decoded whole at that scale (fewer pixels)."""
    data = encode(photo(1200, 1600), quality=90)
    geometry = Geometry("rrc", size=224, scale=(0.9, 1.0))

    def forbidden(*args, **kwargs):
        raise AssertionError("the region decoder ran for a box that DCT scaling covers")

    monkeypatch.setattr(decode, "_region_pixels", forbidden)
    for seed in range(3):
        got = decode_image(data, geometry, np.random.default_rng(seed))
        assert mad(got, reference(data, geometry, seed)) <= DCT_MAD


def test_cmyk_jpeg_takes_the_pillow_path(monkeypatch):
    buf = io.BytesIO()
    Image.fromarray(photo(64, 48)).convert("CMYK").save(buf, "JPEG")
    cmyk = buf.getvalue()
    assert Image.open(io.BytesIO(cmyk)).mode == "CMYK"

    def forbidden(*args, **kwargs):
        raise AssertionError("the region decoder ran for a CMYK JPEG")

    monkeypatch.setattr(decode, "_region_pixels", forbidden)
    geometry = Geometry("rrc", size=24)
    got = decode_image(cmyk, geometry, np.random.default_rng(1))
    assert np.array_equal(got, reference(cmyk, geometry, 1))


@pytest.mark.parametrize("roi", [True, False])
def test_png_and_none_geometry_use_pillow(roi):
    pixels = photo(40, 56)
    png = encode(pixels, "PNG")
    assert np.array_equal(decode_image(png, Geometry("none"), np.random.default_rng(0)), pixels)
    flipped = decode_image(png, Geometry("none", flip_p=1.0), np.random.default_rng(0), roi)
    assert np.array_equal(flipped, pixels[:, ::-1])
    geometry = Geometry("rrc", size=24, flip_p=0.5)
    got = decode_image(png, geometry, np.random.default_rng(3), roi)
    assert np.array_equal(got, reference(png, geometry, 3))  # same library, same box: exact


def test_flip_is_drawn_after_the_box():
    data = encode(photo(96, 80))
    plain = Geometry("rrc", size=32)
    flipped = Geometry("rrc", size=32, flip_p=1.0)
    for seed in range(4):
        a = decode_image(data, plain, np.random.default_rng(seed))
        b = decode_image(data, flipped, np.random.default_rng(seed))
        assert np.array_equal(a[:, ::-1], b)


def batch_payloads() -> list[bytes]:
    good = [encode(photo(60 + 7 * i, 80 - 3 * i, seed=i), quality=85) for i in range(9)]
    broken = encode(photo(64, 64))[:200]  # header and a few bytes of scan data
    return good[:4] + [broken] + good[4:] + [b"not an image at all"]


def test_decode_batch_same_for_any_thread_count():
    payloads = batch_payloads()
    geometry = Geometry("rrc", size=32, flip_p=0.5)

    def run(threads: int) -> list:
        rngs = [np.random.default_rng([7, i]) for i in range(len(payloads))]
        return decode_batch(payloads, geometry, rngs, threads=threads)

    one = run(1)
    assert len(one) == len(payloads)
    for threads in (3, 2, 4):  # the pool grows from 2 to 3 threads, and is reused for 2
        other = run(threads)
        for i, (a, b) in enumerate(zip(one, other, strict=True)):
            if i in (4, len(payloads) - 1):
                assert isinstance(a, ValueError) and isinstance(b, ValueError)
                assert str(a) == str(b)
            else:
                assert isinstance(a, np.ndarray) and a.shape == (32, 32, 3)
                assert np.array_equal(a, b), (threads, i)
    three = run(3)
    # Each entry is the image's own decode: independent of its neighbours and of the order.
    solo = decode_image(payloads[2], geometry, np.random.default_rng([7, 2]))
    assert np.array_equal(three[2], solo)


def test_broken_jpeg_gives_a_readable_reason():
    payloads = batch_payloads()
    rngs = [np.random.default_rng(i) for i in range(len(payloads))]
    results = decode_batch(payloads, Geometry("center", size=32), rngs, threads=2)
    truncated, garbage = results[4], results[-1]
    assert isinstance(truncated, ValueError) and isinstance(garbage, ValueError)
    assert "truncated" in str(truncated).lower()
    assert "unknown image format, starts b'not an i'" in str(garbage)
    for error in (truncated, garbage):
        assert str(error).startswith("cannot decode image (")
        assert " object at 0x" not in str(error)


def test_decode_batch_checks_its_arguments():
    with pytest.raises(ValueError, match="one generator per image"):
        decode_batch([b"x"], Geometry("none"), [])
    with pytest.raises(ValueError, match="threads must be >= 1"):
        decode_batch([b"x"], Geometry("none"), [np.random.default_rng(0)], threads=0)
    assert decode_batch([], Geometry("none"), [], threads=4) == []


def _child_decode(queue, payloads, geometry) -> None:
    rngs = [np.random.default_rng([7, i]) for i in range(len(payloads))]
    results = decode_batch(payloads, geometry, rngs, threads=3)
    pool_id = id(_threads._pool[1]) if _threads._pool else None
    pixels = [r if isinstance(r, np.ndarray) else str(r) for r in results]
    queue.put((pixels, pool_id, jpeg_region_decoder()))


def test_forked_child_gets_its_own_pool_and_decoders():
    payloads = batch_payloads()
    geometry = Geometry("rrc", size=32, flip_p=0.5)
    rngs = [np.random.default_rng([7, i]) for i in range(len(payloads))]
    parent = decode_batch(payloads, geometry, rngs, threads=3)  # creates this process's pool
    parent_pool_id = id(_threads._pool[1])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_decode, args=(queue, payloads, geometry))
    child.start()
    results, child_pool_id, child_decoder = queue.get(timeout=120)  # a reused pool would hang
    child.join(timeout=60)
    assert child.exitcode == 0
    assert child_pool_id is not None and child_pool_id != parent_pool_id
    assert child_decoder == jpeg_region_decoder()  # the child decodes regions too (if we do)
    for a, b in zip(parent, results, strict=True):
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b)
        else:
            assert str(a) == b
