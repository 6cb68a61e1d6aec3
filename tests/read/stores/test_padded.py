"""The pre-padded, mirrored store: its windows equal the NCHW crop kernel's, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

from fastdata.augment import crop_with_padding
from fastdata.read.stores.padded import PaddedImages, padded_nbytes

CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.gpu,
)


def _images(n: int, c: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("channels", "pad"), [(3, 4), (1, 2), (5, 3), (3, 0)])
def test_windows_equal_the_crop_kernel(device, channels, pad):
    images = _images(40, channels, 7, 5)
    store = PaddedImages.build(images, pad, device)
    assert store.data.device.type == device and len(store) == 40 and store.mirrored
    assert store.nbytes == padded_nbytes(40, channels, 7, 5, pad)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        rows = torch.randperm(40, generator=g)[:11]
        offsets = torch.randint(0, 2 * pad + 1, (11, 2), generator=g)
        flip = torch.rand(11, generator=g) < 0.5
        got = store.windows(rows.to(device), offsets, flip)
        expected = crop_with_padding(images[rows], pad, offsets, flip)
        assert got.dtype == torch.uint8 and got.is_contiguous()
        assert torch.equal(got.cpu(), expected)
    rows = torch.tensor([3, 0, 39])
    assert torch.equal(store.windows(rows.to(device)).cpu(), images[rows]), "no offsets: the image"


def test_every_offset_and_both_orientations_at_the_edges():
    images = _images(2, 3, 4, 6)
    store = PaddedImages.build(images, 2)
    for dy in range(5):
        for dx in range(5):
            for flip in (False, True):
                offsets, mask = torch.tensor([[dy, dx]] * 2), torch.tensor([flip, not flip])
                expected = crop_with_padding(images, 2, offsets, mask)
                assert torch.equal(store.windows(torch.arange(2), offsets, mask), expected)


def test_narrow_index_dtypes_are_widened():
    # uint8 offsets times the row length would wrap at 256; int32 rows overflow in big stores.
    images = _images(3, 3, 4, 70)
    store = PaddedImages.build(images, 4)
    offsets = torch.tensor([[8, 8], [3, 0], [0, 5]])
    flip = torch.tensor([1, 0, 1], dtype=torch.uint8)
    expected = crop_with_padding(images, 4, offsets, flip.bool())
    got = store.windows(torch.arange(3, dtype=torch.int32), offsets.to(torch.uint8), flip)
    assert torch.equal(got, expected)


def test_windows_write_into_out_and_unmirrored_stores_refuse_flips():
    images = _images(6, 3, 4, 4)
    store = PaddedImages.build(images, 1, mirrored=False)
    assert store.nbytes == padded_nbytes(6, 3, 4, 4, 1, mirrored=False)
    out = torch.empty(2, 3, 4, 4, dtype=torch.uint8)
    got = store.windows(torch.tensor([5, 2]), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, images[[5, 2]])
    with pytest.raises(ValueError, match="mirrored"):
        store.windows(torch.tensor([0]), torch.tensor([[0, 0]]), torch.tensor([True]))


def test_building_runs_in_chunks(monkeypatch):
    from fastdata.read.stores import padded

    monkeypatch.setattr(padded, "_BUILD_CHUNK_BYTES", 1)  # one image per chunk
    images = _images(5, 3, 3, 3)
    store = PaddedImages.build(images, 2)
    assert torch.equal(store.windows(torch.arange(5)), images)
    flip = torch.ones(5, dtype=torch.bool)
    assert torch.equal(store.windows(torch.arange(5), torch.full((5, 2), 2), flip), images.flip(-1))


@pytest.mark.parametrize(
    ("images", "pad", "match"),
    [
        (torch.zeros(2, 3, 4, 4, dtype=torch.float32), 1, "uint8"),
        (torch.zeros(0, 3, 4, 4, dtype=torch.uint8), 1, "non-empty"),
        (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), -1, "pad"),
    ],
)
def test_bad_input_is_refused(images, pad, match):
    with pytest.raises(ValueError, match=match):
        PaddedImages.build(images, pad)


@pytest.mark.parametrize(("pad", "mirrored"), [(4, True), (0, True), (2, False)])
def test_threaded_build_writes_the_sequential_bytes(monkeypatch, pad, mirrored):
    from fastdata.read.stores import padded

    monkeypatch.setattr(padded, "_BUILD_CHUNK_BYTES", 700)  # a few images per chunk: 20+ chunks
    images = _images(67, 3, 5, 6, seed=4)
    sequential = PaddedImages.build(images, pad, mirrored=mirrored, threads=1)
    threaded = PaddedImages.build(images, pad, mirrored=mirrored, threads=3)
    assert torch.equal(sequential.data, threaded.data)
    expected = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    assert torch.equal(threaded.data[0], expected), "copy 0: the zero-padded images"
    if mirrored:
        assert torch.equal(threaded.data[1], expected.flip(-1)), "copy 1: their mirror"
    assert threaded.data.shape[0] == (2 if mirrored else 1)
