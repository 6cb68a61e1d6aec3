"""Tests of fastdata.augment: kernels, parameter sampling and presets (CPU; CUDA when present)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdata import augment as A

CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.gpu,
)
DEVICES = ["cpu", CUDA]


def _images(n: int, h: int, w: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8).to(device)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- presets
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("name", "image_size", "in_hw", "out_hw"),
    [
        ("cifar", None, (32, 32), (32, 32)),
        ("photo", 16, (16, 16), (16, 16)),
        ("photo", 16, (40, 30), (16, 16)),  # the crops run on the device from any stored size
        ("none", None, (20, 24), (20, 24)),
    ],
)
@pytest.mark.parametrize("train", [True, False])
def test_apply_shape_dtype_device(device, name, image_size, in_hw, out_hw, train):
    preset = A.get_preset(name, image_size=image_size)
    x = _images(5, *in_hw, device=device)
    y = preset.apply(x, train=train, generator=_gen(0))
    assert y.shape == (5, 3, *out_hw)
    assert y.dtype == torch.float32
    assert y.device == x.device
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["cifar", "photo"])
def test_apply_is_deterministic_for_a_seed(name):
    preset = A.get_preset(name, image_size=None if name == "cifar" else 24)
    x = _images(16, 32, 32)
    first = preset.apply(x, True, _gen(7))
    assert torch.equal(first, preset.apply(x, True, _gen(7)))
    assert not torch.equal(first, preset.apply(x, True, _gen(8)))


@pytest.mark.parametrize("name", ["cifar", "photo"])
@pytest.mark.parametrize("train", [True, False])
def test_channels_last_input_gives_the_same_result(name, train):
    preset = A.get_preset(name, image_size=None if name == "cifar" else 24)
    x = _images(8, 32, 32)
    expected = preset.apply(x, train, _gen(3))
    got = preset.apply(x.contiguous(memory_format=torch.channels_last), train, _gen(3))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_none_preset_scales_to_unit_interval():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    y = A.get_preset("none").apply(x, train=True)
    torch.testing.assert_close(y[0, :, 0, 0], torch.tensor([0.0, 0.2, 1.0]))


def test_cifar_eval_is_normalize_only():
    x = _images(4, 32, 32)
    y = A.get_preset("cifar").apply(x, train=False)
    torch.testing.assert_close(y, A.normalize(x, A.CIFAR100_MEAN, A.CIFAR100_STD), rtol=0, atol=0)


def test_get_preset_overrides_and_errors():
    preset = A.get_preset("photo", image_size=64, mean=(1, 2, 3), std=(4, 5, 6))
    assert (preset.image_size, preset.mean, preset.std) == (64, (1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    assert A.get_preset("photo").image_size == 224
    with pytest.raises(ValueError, match="unknown augmentation preset 'imagenet'"):
        A.get_preset("imagenet")
    with pytest.raises(ValueError, match="image_size=16 .* into 20x20 images"):
        # No op resizes the input (the pad-crop keeps its size): the size check catches it.
        A.get_preset("cifar", image_size=16).apply(_images(2, 20, 20), train=True)
    with pytest.raises(ValueError, match="got shape"):
        A.get_preset("cifar").apply(torch.zeros(2, 1, 32, 32, dtype=torch.uint8), train=True)
    with pytest.raises(ValueError, match="needs image_size"):
        A.Preset("p", None, (0.0,), (1.0,), (A.ResizeCenterCrop(),))
    with pytest.raises(ValueError, match="op 'blur' is not callable"):
        A.Preset("p", None, (0.0,), (1.0,), ("blur",))


# ----------------------------------------------------------------------------- flip
def test_flip_mirrors_exactly_the_masked_samples():
    x = _images(6, 5, 7)
    mask = torch.tensor([True, False, False, True, True, False])
    y = A.flip_horizontal(x, mask)
    for i in range(6):
        assert torch.equal(y[i], x[i].flip(-1) if mask[i] else x[i])


def test_random_flip_rate():
    x = torch.arange(2, dtype=torch.uint8).view(1, 1, 1, 2).expand(4000, 3, 1, 2)
    flipped = (A.random_flip(x, _gen(0))[:, 0, 0, 0] == 1).float().mean().item()
    assert 0.45 < flipped < 0.55
    assert torch.equal(A.random_flip(x, _gen(0), p=0.0), x)


# ----------------------------------------------------------------------------- pad-crop
def test_pad_crop_output_is_a_window_of_the_padded_input():
    x = _images(6, 32, 32, seed=1)
    y = A.random_crop_with_padding(x, 4, _gen(0))
    padded = F.pad(x, (4, 4, 4, 4))
    for i in range(len(x)):
        windows = [
            (dy, dx)
            for dy in range(9)
            for dx in range(9)
            if torch.equal(y[i], padded[i, :, dy : dy + 32, dx : dx + 32])
        ]
        assert len(windows) == 1, f"sample {i}: matches {windows}"


def test_crop_with_padding_uses_the_given_offsets():
    x = _images(3, 6, 5)
    offsets = torch.tensor([[0, 0], [4, 4], [1, 3]])
    y = A.crop_with_padding(x, 2, offsets)
    padded = F.pad(x, (2, 2, 2, 2))
    for i, (dy, dx) in enumerate(offsets.tolist()):
        assert torch.equal(y[i], padded[i, :, dy : dy + 6, dx : dx + 5])


def test_fused_crop_and_flip_equal_the_two_separate_ops():
    x = _images(64, 32, 32)
    fused = A.random_crop_with_padding(x, 4, _gen(2), flip_p=0.5)
    g = _gen(2)
    assert torch.equal(fused, A.random_flip(A.random_crop_with_padding(x, 4, g), g))
    offsets, flip = torch.randint(0, 9, (64, 2)), torch.rand(64) < 0.5
    expected = A.flip_horizontal(A.crop_with_padding(x, 4, offsets), flip)
    assert torch.equal(A.crop_with_padding(x, 4, offsets, flip), expected)


def test_cifar_train_is_pad_crop_then_flip_then_normalize():
    x = _images(32, 32, 32)
    g = _gen(4)
    expected = A.random_flip(A.random_crop_with_padding(x, 4, g), g)
    expected = A.normalize(expected, A.CIFAR100_MEAN, A.CIFAR100_STD)
    assert torch.equal(A.get_preset("cifar").apply(x, True, _gen(4)), expected)


def test_pad_crop_offsets_are_roughly_uniform():
    # Channel 0 holds row + 1 and channel 1 holds column + 1, so the centre pixel of a crop tells
    # its offset: the centre never falls into the padding since |offset - 4| <= 4 < 16.
    n, rows = 4500, torch.arange(32, dtype=torch.uint8)
    x = torch.stack([rows[:, None].expand(32, 32) + 1, rows[None, :].expand(32, 32) + 1])
    x = torch.cat([x, x[:1]]).expand(n, 3, 32, 32)
    y = A.random_crop_with_padding(x, 4, _gen(0))
    dy = y[:, 0, 16, 16].long() - 1 - 16 + 4
    dx = y[:, 1, 16, 16].long() - 1 - 16 + 4
    for offsets in (dy, dx):
        counts = torch.bincount(offsets, minlength=9)
        assert len(counts) == 9 and counts.min() > 0.7 * n / 9 and counts.max() < 1.3 * n / 9
    assert len(set(zip(dy.tolist(), dx.tolist(), strict=True))) == 81


# ----------------------------------------------------------------------------- rrc params
def _reference_rrc(height, width, scale, ratio, rng):
    """torchvision RandomResizedCrop.get_params, written from its documentation, numpy draws."""
    area = height * width
    log_ratio = np.log(np.array(ratio))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.integers(0, height - h + 1))
            j = int(rng.integers(0, width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


@pytest.mark.parametrize(
    ("height", "width", "scale"),
    [
        (375, 500, (0.08, 1.0)),
        (32, 32, (0.08, 1.0)),
        (10, 1000, (0.08, 1.0)),  # too wide for any try: centre fallback, ratio-clamped
        (1000, 10, (0.08, 1.0)),
        (50, 60, (2.0, 3.0)),  # area too large for any try: fallback to the whole image
    ],
)
def test_rrc_params_matches_torchvision_algorithm(height, width, scale):
    ratio = (3 / 4, 4 / 3)
    for seed in range(200):
        got = A.rrc_params(height, width, scale, ratio, np.random.default_rng(seed))
        assert got == _reference_rrc(height, width, scale, ratio, np.random.default_rng(seed))
        top, left, h, w = got
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 < w


def test_rrc_params_rejects_bad_ranges():
    with pytest.raises(ValueError, match="scale"):
        A.rrc_params(10, 10, (0.9, 0.1), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="ratio"):
        A.batch_rrc_params((2, 10, 10), ratio=(0.0, 1.0))


def test_batch_rrc_params_follows_the_same_distribution():
    n, height, width = 3000, 120, 90
    boxes = A.batch_rrc_params((n, height, width), generator=_gen(0))
    rng = np.random.default_rng(0)
    ref = torch.tensor([A.rrc_params(height, width, rng=rng) for _ in range(n)])
    assert boxes.shape == (n, 4) and boxes.dtype == torch.int64
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (h > 0).all() and (w > 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    for stat in (
        lambda b: (b[:, 2] * b[:, 3]).double() / (height * width),  # area fraction
        lambda b: (b[:, 3].double() / b[:, 2]).log(),  # log aspect ratio
        lambda b: (b[:, 0] + b[:, 2] / 2).double() / height,  # vertical centre
    ):
        assert abs(stat(boxes).mean() - stat(ref).mean()) < 0.03
        assert abs(stat(boxes).std() - stat(ref).std()) < 0.03


def test_batch_rrc_params_per_sample_sizes_and_fallback():
    sizes = torch.tensor([[10, 1000], [1000, 10], [64, 48]]).repeat(50, 1)
    boxes = A.batch_rrc_params(sizes, generator=_gen(1))
    assert (boxes[:, 0] + boxes[:, 2] <= sizes[:, 0]).all()
    assert (boxes[:, 1] + boxes[:, 3] <= sizes[:, 1]).all()
    # No try fits a 10x1000 or 1000x10 image: the centre fallback of the reference algorithm.
    ref_wide = _reference_rrc(10, 1000, (0.08, 1.0), (3 / 4, 4 / 3), np.random.default_rng(0))
    ref_tall = _reference_rrc(1000, 10, (0.08, 1.0), (3 / 4, 4 / 3), np.random.default_rng(0))
    assert (boxes[0::3] == torch.tensor(ref_wide)).all()
    assert (boxes[1::3] == torch.tensor(ref_tall)).all()


# ----------------------------------------------------------------------------- resize
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(20, 20), (80, 90), (37, 50), (10, 70)])
def test_resized_crop_of_the_whole_image_is_a_plain_resize(device, size):
    x = _images(3, 37, 50, device=device)
    boxes = torch.tensor([[0, 0, 37, 50]]).expand(3, 4)
    expected = F.interpolate(x.float(), size=size, mode="bilinear", antialias=True)
    torch.testing.assert_close(A.resized_crop(x, boxes, size), expected, rtol=0, atol=1e-3)


@pytest.mark.parametrize("antialias", [True, False])
def test_resized_crop_crops_each_sample_to_its_own_box(antialias):
    x = _images(4, 37, 50)
    boxes = torch.tensor([[3, 5, 20, 30], [0, 0, 10, 10], [17, 20, 20, 30], [1, 1, 36, 49]])
    y = A.resized_crop(x, boxes, (16, 24), antialias=antialias)
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        crop = x[i : i + 1, :, top : top + h, left : left + w].float()
        expected = F.interpolate(crop, size=(16, 24), mode="bilinear", antialias=antialias)
        torch.testing.assert_close(y[i : i + 1], expected, rtol=0, atol=1e-3)


def test_warp_of_whole_pixel_regions_is_resized_crop_then_flip():
    # One set of filter weights (kernels.resize_weights) serves both: a target warp of a box on
    # whole pixels is the crop-then-resize of resized_crop, mirrored where the region says so.
    from fastdata.augment.region import Region
    from fastdata.augment.warp import warp_images

    x = _images(3, 37, 50)
    boxes = torch.tensor([[3, 5, 20, 30], [0, 0, 37, 50], [17, 20, 20, 30]])  # top, left, h, w
    flips = [False, True, True]
    regions = [
        Region((left, top, left + w, top + h), flip, (16, 24))
        for (top, left, h, w), flip in zip(boxes.tolist(), flips, strict=True)
    ]
    warped = warp_images(x, regions, antialias=True, dtype=torch.float32)
    expected = A.resized_crop(x, boxes, (16, 24))
    expected[1:] = expected[1:].flip(-1)
    torch.testing.assert_close(warped, expected, rtol=0, atol=1e-4)


def test_resize_weights_reach_padding_past_the_edges():
    from fastdata.augment.kernels import resize_weights

    # A span from -2 to 6 over a 4-pixel axis: 2 padding pixels on each side count in the
    # normalization, then are cut off, so the weights of the real pixels sum to less than 1.
    w = resize_weights(torch.tensor([-2.0]), torch.tensor([8.0]), 4, 4, True, pad=(2, 2))
    assert w.shape == (1, 4, 4)
    # Output pixel 0 is centred at -1 (half-width 2): taps -1.5 and -0.5 (padding, 0.75 each)
    # and 0.5 (pixel 0, 0.25) -> 0.25 / 1.75 for pixel 0, the padding's share cut off.
    torch.testing.assert_close(w[0, 0], torch.tensor([1 / 7, 0.0, 0.0, 0.0]))
    inside = resize_weights(torch.tensor([0.0]), torch.tensor([4.0]), 4, 2, True)
    torch.testing.assert_close(inside.sum(2), torch.ones(1, 2))
    mirror = torch.tensor([True])
    flipped = resize_weights(torch.tensor([-2.0]), torch.tensor([8.0]), 4, 4, True, mirror, (2, 2))
    assert torch.equal(flipped, w.flip(1))


@pytest.mark.parametrize(("height", "width"), [(60, 80), (80, 60), (48, 48)])
def test_resize_center_crop_crops_the_centre_box_then_resizes(height, width):
    x = _images(2, height, width)
    top, left, h, w = A.center_crop_box(height, width, 32, 256 / 224)
    # floor(32 * 256 / 224) = 36: the box keeps 32 / 36 of the shorter side, centred.
    assert h == w == round(min(height, width) * 32 / 36)
    assert (top, left) == ((height - h) // 2, (width - w) // 2)
    crop = x[:, :, top : top + h, left : left + w].float()
    expected = F.interpolate(crop, size=(32, 32), mode="bilinear", antialias=True)
    torch.testing.assert_close(A.resize_center_crop(x, 32), expected, rtol=0, atol=1e-3)


def test_center_crop_box_is_the_decoders_box():
    from fastdata.read.decoders.image import Geometry, draw_crop

    assert A.center_crop_box(375, 500, 224) == (23, 86, 328, 328)
    assert A.center_crop_box(500, 375, 224) == (86, 23, 328, 328)
    assert A.center_crop_box(300, 400, (224, 112)) == (19, 134, 262, 131)  # the output's aspect
    assert A.center_crop_box(182, 200, 160) == (11, 20, 160, 160)  # stored at floor(160 * 8 / 7)
    for hw in [(375, 500), (500, 375), (61, 61), (3, 200)]:
        (left, top, right, bottom), _ = draw_crop(hw[::-1], Geometry("center", 224), None)
        assert A.center_crop_box(*hw, 224) == (top, left, bottom - top, right - left)
    with pytest.raises(ValueError, match="resize_ratio"):
        A.center_crop_box(10, 10, 8, 0.5)


def test_the_device_centre_crop_gives_the_cpu_decoders_pixels():
    """One geometry: the eval crop of an image on the device (raw splits, the memory store)
    equals the cpu backend's decode-time centre crop of the same image, within a grey level."""
    import io

    from PIL import Image

    from fastdata.read.decoders.image import Geometry, decode_image

    x = _images(1, 60, 90, seed=3)
    png = io.BytesIO()
    Image.fromarray(x[0].permute(1, 2, 0).numpy()).save(png, "PNG")
    decoded = decode_image(png.getvalue(), Geometry("center", 28), np.random.default_rng(0))
    device = A.resize_center_crop(x, 28).round().clamp(0, 255)[0].permute(1, 2, 0)
    assert (device - torch.from_numpy(np.array(decoded)).float()).abs().max() <= 1


# ----------------------------------------------------------------------------- normalize
def test_normalize_uses_the_given_mean_and_std():
    x = _images(2, 4, 5)
    mean, std = (10.0, 20.0, 30.0), (2.0, 4.0, 8.0)
    y = A.normalize(x, mean, std)
    expected = (x.float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    assert torch.equal(y, expected)
    white = A.normalize(
        torch.full((1, 3, 1, 1), 255, dtype=torch.uint8), A.CIFAR100_MEAN, A.CIFAR100_STD
    )
    expected_white = [(255 - m) / s for m, s in zip(A.CIFAR100_MEAN, A.CIFAR100_STD, strict=True)]
    torch.testing.assert_close(white.flatten(), torch.tensor(expected_white))


def test_normalize_dtype_memory_format_and_input_untouched():
    x = _images(2, 4, 5).float()
    before = x.clone()
    y = A.normalize(x, A.IMAGENET_MEAN, A.IMAGENET_STD, dtype=torch.bfloat16, channels_last=True)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="got shape"):
        A.normalize(x[:, :2], A.IMAGENET_MEAN, A.IMAGENET_STD)


@pytest.mark.parametrize("n, side", [(0, 8), (1, 600), (3, 300), (37, 32), (5, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("path", ["table", "numpy", "float input"])
def test_cpu_normalize_equals_the_whole_batch_formula(monkeypatch, n, side, channels_last, path):
    """On the CPU, uint8 batches go through a per-channel table (`fastdata/_pixels.c`) or numpy chunks, float
    ones through numpy chunks: bit for bit ``(x - mean) / std``, any size and layout."""
    from fastdata.augment import kernels

    if path == "table" and kernels._pixels is None:
        pytest.skip("fastdata._pixels was not built")
    if path == "numpy":
        monkeypatch.setattr(kernels, "_pixels", None)
    x = torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8)
    if path == "float input":
        x = x.float()
    mean, std = A.IMAGENET_MEAN, A.IMAGENET_STD
    expected = (x.float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full(x.shape, float("nan")).contiguous(memory_format=fmt)
    for given in (None, out):
        y = A.normalize(x, mean, std, channels_last=channels_last, out=given)
        assert torch.equal(y, expected) and y.is_contiguous(memory_format=fmt)
    assert A.normalize(x, mean, std, out=out) is out
    if channels_last:  # a planar batch into a channels-last result: numpy's strided path
        y = A.normalize(x.contiguous(), mean, std, channels_last=True)
        assert torch.equal(y, expected) and y.is_contiguous(memory_format=fmt)


def test_cpu_normalize_keeps_gradients_of_float_inputs():
    """A float batch that needs gradients (e.g. an adversarial input) is normalized by torch's
    differentiable ops, not the numpy fast path; also when the constants were first made in
    inference mode (Lightning validates in it)."""
    from fastdata.augment import kernels

    kernels._mean_std.cache_clear()
    with torch.inference_mode():
        A.normalize(torch.rand(1, 3, 2, 2), A.IMAGENET_MEAN, A.IMAGENET_STD)
    x = torch.rand(2, 3, 4, 4, requires_grad=True)
    y = A.normalize(x * 255, A.IMAGENET_MEAN, A.IMAGENET_STD)
    assert y.requires_grad
    y.sum().backward()
    expected = 255 / torch.tensor(A.IMAGENET_STD).view(1, 3, 1, 1).expand_as(x)
    assert torch.allclose(x.grad, expected)
    with torch.no_grad():  # no gradients asked: the fast path
        assert not A.normalize(x, A.IMAGENET_MEAN, A.IMAGENET_STD).requires_grad


def test_pixels_extension_checks_its_buffers():
    from fastdata.augment import kernels

    if kernels._pixels is None:
        pytest.skip("fastdata._pixels was not built")
    x = np.zeros(12, np.uint8)
    table = np.zeros((3, 256), np.float32)
    with pytest.raises(ValueError, match="channels x 256"):
        kernels._pixels.normalize_planes(x, np.zeros(12, np.float32), table[:2], 3, 4)
    with pytest.raises(ValueError, match="one float32 per byte"):
        kernels._pixels.normalize_planes(x, np.zeros(11, np.float32), table, 3, 4)
    with pytest.raises(ValueError, match="whole N x C planes"):
        kernels._pixels.normalize_planes(x, np.zeros(12, np.float32), table, 3, 5)
    # sizes whose products overflow are refused, never wrapped (a crash or a write past x)
    with pytest.raises(ValueError, match="whole N x C planes"):
        kernels._pixels.normalize_planes(x, np.zeros(12, np.float32), table, 3, (2**64 + 4) // 3)
    with pytest.raises(ValueError, match="channels x 256"):
        kernels._pixels.normalize_planes(x, np.zeros(12, np.float32), table, 2**62, 4)
    with pytest.raises(ValueError, match="height x width x 3"):
        kernels._pixels.to_planes(x[:3], x[3:6].copy(), 7, pow(7, -1, 2**64) // 2, False)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cifar", "photo", "none"])
def test_cuda_matches_cpu_with_a_cpu_generator(name):
    preset = A.get_preset(name, image_size=None if name in ("cifar", "none") else 24)
    x = _images(16, 24 if name == "photo" else 32, 24 if name == "photo" else 32)
    for train in (True, False):
        cpu = preset.apply(x, train, _gen(5))
        cuda = preset.apply(x.cuda(), train, _gen(5))
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=1e-3)
        assert preset.apply(x.cuda(), train).device.type == "cuda"  # default CUDA generator


@pytest.mark.parametrize("h, w", [(1, 1), (3, 15), (2, 16), (5, 17), (7, 33), (224, 224), (9, 50)])
@pytest.mark.parametrize("flip", [False, True])
def test_to_planes_equals_numpy_transpose(h, w, flip):
    """`_pixels.to_planes`: interleaved RGB to planes (16 pixels a step, the rest one by one)."""
    _pixels = pytest.importorskip("fastdata._pixels", reason="fastdata._pixels was not built")
    src = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    dst = np.full((3, h, w), 7, np.uint8)
    _pixels.to_planes(src, dst, h, w, flip)
    want = src[:, ::-1] if flip else src
    assert np.array_equal(dst, want.transpose(2, 0, 1))
    with pytest.raises(ValueError, match="height x width x 3"):
        _pixels.to_planes(src, dst, h, w + 1, flip)
