"""`resize_aa` (the pixels of antialiased bilinear `interpolate`) and decoding into a batch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fastdata.read.decoders import resize
from fastdata.read.decoders.image import Geometry, decode_batch
from fastdata.read.decoders.resize import resize_aa


def region(h: int, w: int, seed: int) -> torch.Tensor:
    """(1, 3, h, w) uint8 channels-last, as a decoded HWC region becomes in `decode._finish`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([(x * (c + 1) + y * (3 - c)) % 256 for c in range(3)], -1)
    noisy = smooth + rng.integers(-40, 41, smooth.shape)  # hard edges and noise: every tap counts
    hwc = np.clip(noisy, 0, 255).astype(np.uint8)
    return torch.from_numpy(hwc).permute(2, 0, 1)[None]


# Downscales (by 1.01 to 7x), upscales, 1-pixel and very thin boxes, odd sizes.
SHAPES = [(533, 400), (300, 250), (225, 224), (224, 224), (97, 131), (1, 1), (1, 300), (700, 3)]


@pytest.mark.parametrize("size", [224, 33, 1])
def test_resize_aa_gives_interpolates_pixels_planar(size):
    for seed, (h, w) in enumerate(SHAPES):
        x = region(h, w, seed)
        got = resize_aa(x, size)
        want = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)[0]
        assert got.shape == (3, size, size) and got.dtype == torch.uint8
        assert got.is_contiguous(), "the batch takes planar pixels"
        assert torch.equal(got, want), (h, w, size)


def test_resize_aa_without_the_out_op_falls_back(monkeypatch):
    monkeypatch.setattr(resize, "_RESIZE_OUT", None)
    x = region(300, 250, 0)
    want = F.interpolate(x, size=(224, 224), mode="bilinear", antialias=True)[0]
    assert torch.equal(resize_aa(x, 224), want)


def test_resize_aa_uses_a_channels_last_output(monkeypatch):
    """The kernel writes interleaved pixels (its cheap path), then torch copies them to planar."""
    seen = []
    real = resize._RESIZE_OUT
    assert real is not None, "this torch has no aten::_upsample_bilinear2d_aa.out"

    def spy(*args, out):
        seen.append(out.is_contiguous(memory_format=torch.channels_last))
        return real(*args, out=out)

    monkeypatch.setattr(resize, "_RESIZE_OUT", spy)
    resize_aa(region(300, 250, 0), 224)
    assert seen == [True]


def jpeg(h: int, w: int, seed: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(region(h, w, seed)[0].permute(1, 2, 0).numpy()).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    "geometry",
    [
        Geometry("rrc", size=64, flip_p=0.5),
        Geometry("center", size=48),
        Geometry("cover", hw=(40, 56)),
    ],
    ids=["rrc", "center", "cover"],
)
def test_decode_batch_into_out_gives_the_same_pixels(geometry):
    """Decoded straight into a batch: the pixels of decoding then copying, the entries are views
    of the batch, and a failed image's slot is left as it was."""
    payloads = [jpeg(120, 90, 0), jpeg(90, 130, 1, "PNG"), b"not an image", jpeg(200, 150, 2)]
    payloads += [jpeg(75, 75, k) for k in range(3, 9)]  # flips drawn both ways
    n, (h, w) = len(payloads), geometry.out_hw
    rngs = lambda: [np.random.default_rng(i) for i in range(n)]  # noqa: E731
    want = decode_batch(payloads, geometry, rngs())
    out = np.full((n, 3, h, w), 7, np.uint8)
    got = decode_batch(payloads, geometry, rngs(), out=out)
    for i in range(n):
        if i == 2:
            assert isinstance(got[i], ValueError) and isinstance(want[i], ValueError)
            assert (out[i] == 7).all()
            continue
        assert np.array_equal(got[i], want[i]), i
        assert np.array_equal(out[i], want[i].transpose(2, 0, 1)), i
        assert np.shares_memory(got[i], out), i


def test_decode_batch_checks_out():
    geometry = Geometry("rrc", size=32)
    payloads = [jpeg(60, 60, 0)]
    rngs = [np.random.default_rng(0)]
    for bad in (np.empty((1, 3, 32, 31), np.uint8), np.empty((2, 3, 32, 32), np.uint8)):
        with pytest.raises(ValueError, match="out must be a uint8 array of shape"):
            decode_batch(payloads, geometry, rngs, out=bad)
    with pytest.raises(ValueError, match="out must be"):
        decode_batch(payloads, geometry, rngs, out=np.empty((1, 3, 32, 32), np.float32))
