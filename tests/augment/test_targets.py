"""Unit tests of fastdata.augment.targets: regions drawn from presets, exact maps, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastdata.augment import (
    BatchTransform,
    Flip,
    PadCrop,
    Preset,
    RandomResizedCrop,
    Region,
    draw_regions,
    get_preset,
    image_seed,
    rrc_params,
    warp_batch,
    warp_boxes,
    warp_sample,
)


def _preset(train: tuple, eval_ops: tuple = ()) -> Preset:
    return Preset("t", 32, (0.0,) * 3, (1.0,) * 3, train, eval_ops)


# ----------------------------------------------------------------------------- drawing
@pytest.mark.parametrize("name", ["photo", "cifar"])
def test_same_batch_seed_same_regions_other_indices_other_regions(name):
    preset = get_preset(name, 64 if name == "photo" else None)
    sizes = [(97, 131)] * 24
    a = draw_regions(preset, True, sizes, (64, 64), batch_seed=1234)
    assert a == draw_regions(preset, True, sizes, (64, 64), batch_seed=1234)
    # 24 samples of one size: different indices draw different regions (a 9x9 pad-crop grid
    # times a flip has 162 outcomes, so a few may collide by chance; rrc boxes never do).
    distinct = len({(r.box, r.flip) for r in a})
    assert distinct == 24 if name == "photo" else distinct >= 16
    b = draw_regions(preset, True, sizes, (64, 64), batch_seed=1235)
    assert sum(x != y for x, y in zip(a, b, strict=True)) >= 20


def test_regions_follow_image_seed_and_rrc_params():
    """Sample i draws rrc_params then the flip from default_rng(image_seed(seed, i))."""
    preset = get_preset("photo", 48)
    sizes = [(80, 120), (200, 50), (33, 33)]
    regions = draw_regions(preset, True, sizes, (48, 48), batch_seed=77)
    for i, ((h, w), region) in enumerate(zip(sizes, regions, strict=True)):
        rng = np.random.default_rng(image_seed(77, i))
        top, left, bh, bw = rrc_params(h, w, rng=rng)
        assert region.box == (left, top, left + bw, top + bh)
        assert region.flip == bool(rng.random() < 0.5)
        assert region.out_hw == (48, 48)
    seeds = [5, 6, 7]
    own = draw_regions(preset, True, sizes, (48, 48), batch_seed=0, seeds=seeds)
    assert own[0] == draw_regions(preset, True, sizes[:1], (48, 48), 0, seeds=[5])[0]
    assert own != regions


def test_eval_and_none_regions():
    photo = get_preset("photo", 224)
    # eval: the centred square of 224/256 of the shorter side (decode.py's "center" crop)
    (r,) = draw_regions(photo, False, [(300, 400)], (224, 224), batch_seed=3)
    side = round(300 * 224 / 256)  # 262
    top, left = (300 - side) // 2, (400 - side) // 2
    assert r == Region((left, top, left + side, top + side), False, (224, 224))
    assert r.box == (69.0, 19.0, 331.0, 281.0)
    for name in ("none", "cifar"):  # no eval ops; "none" has no train ops either
        for train in (False, True) if name == "none" else (False,):
            (r,) = draw_regions(get_preset(name), train, [(45, 70)], (32, 40), batch_seed=9)
            assert r == Region((0.0, 0.0, 70.0, 45.0), False, (32, 40))


def test_pad_crop_box_reaches_past_the_image():
    preset = _preset((PadCrop(pad=4, flip_p=0.0),))
    regions = draw_regions(preset, True, [(32, 32)] * 64, (32, 32), batch_seed=5)
    x0s = {r.box[0] for r in regions}
    assert x0s == {float(v) for v in range(-4, 5)}  # 64 draws cover all 9 offsets
    assert all(r.box[2] - r.box[0] == 32 and r.box[3] - r.box[1] == 32 for r in regions)
    assert not any(r.flip for r in regions)


def test_composed_ops_fold_into_one_region():
    """Flip then pad-crop: the pad-crop's offset is taken in the mirrored canvas."""
    preset = _preset((Flip(1.0), PadCrop(pad=3, flip_p=0.0)))
    (r,) = draw_regions(preset, True, [(20, 30)], (20, 30), batch_seed=1)
    rng = np.random.default_rng(image_seed(1, 0))
    rng.random()  # the flip
    dy, dx = int(rng.integers(0, 7)), int(rng.integers(0, 7))
    # canvas column u is source column 30 - u: a window starting at canvas dx - 3 ends at
    # source 30 - (dx - 3) and starts 30 columns left of that
    assert r.box == (float(-(dx - 3)), float(dy - 3), float(30 - (dx - 3)), float(dy - 3 + 20))
    assert r.flip


def test_user_callables_are_refused_or_skipped():
    preset = _preset((RandomResizedCrop(), BatchTransform(lambda x: x)))
    with pytest.raises(ValueError, match="cannot move masks or boxes.*allow_custom"):
        draw_regions(preset, True, [(40, 40)], (32, 32), batch_seed=0)
    (r,) = draw_regions(preset, True, [(40, 40)], (32, 32), batch_seed=0, allow_custom=True)
    assert r.out_hw == (32, 32)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="x1 > x0"):
        Region((5.0, 0.0, 5.0, 4.0), False, (4, 4))
    with pytest.raises(ValueError, match="out_hw"):
        Region((0.0, 0.0, 5.0, 4.0), False, (0, 4))
    with pytest.raises(ValueError, match="one seed per sample"):
        draw_regions(get_preset("none"), True, [(4, 4)], (4, 4), 0, seeds=[1, 2])
    with pytest.raises(ValueError, match="sample 1 has size"):
        draw_regions(get_preset("none"), True, [(4, 4), (0, 4)], (4, 4), 0)


# ----------------------------------------------------------------------------- boxes
def test_warp_boxes_maps_clips_flips_and_drops_with_labels():
    region = Region((10.0, 20.0, 50.0, 60.0), True, (80, 40))  # x scale 1, y scale 2, flipped
    boxes = np.array(
        [
            [12, 22, 20, 30],  # inside
            [0, 0, 5, 5],  # missed entirely: dropped
            [45, 50, 70, 90],  # crosses the right and bottom of the crop: clipped
            [30, 60, 40, 70],  # touches the crop's bottom edge: no area left, dropped
            [-10, 25, 11, 26],  # reaches past the image's left edge: clipped to it first
        ],
        np.float32,
    )
    labels = np.array([1, 2, 3, 4, 5])
    out, kept = warp_boxes(boxes, labels, region, (100, 100))
    assert kept.tolist() == [1, 3, 5] and kept.dtype == torch.int64
    assert out.dtype == torch.float32
    expected = [
        [40 - 10, 4, 40 - 2, 20],  # x 12..20 -> 2..10 -> mirrored 30..38; y 22..30 -> 4..20
        [0, 60, 40 - 35, 80],  # x 45..50(clip) -> 35..40 -> 0..5; y 50..60 -> 60..80
        [40 - 1, 10, 40, 12],  # x 0(image)..11 -> clip 10..11 -> 0..1 -> 39..40
    ]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32))
    empty, none = warp_boxes(np.zeros((0, 4), np.float32), None, region, (100, 100))
    assert empty.shape == (0, 4) and none is None
    with pytest.raises(ValueError, match="3 boxes but 2 box labels"):
        warp_boxes(boxes[:3], labels[:2], region, (100, 100))
    with pytest.raises(ValueError, match=r"shape \(k, 4\)"):
        warp_boxes(np.zeros((2, 3)), None, region, (100, 100))


# ----------------------------------------------------------------------------- images and masks
def test_warp_sample_is_crop_then_resize():
    """A whole-pixel box inside the image: torch's antialiased resize of the crop, then the flip."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    region = Region((7.0, 3.0, 62.0, 44.0), True, (20, 25))
    crop = torch.from_numpy(image).permute(2, 0, 1)[None, :, 3:44, 7:62].float()
    want = F.interpolate(crop, size=(20, 25), mode="bilinear", antialias=True)[0].flip(-1)
    got = warp_sample(image, region)["image"]
    assert got.shape == (3, 20, 25) and got.dtype == torch.uint8
    assert (got.float() - want).abs().max() <= 1.0
    # The same image as CHW tensor, and the batched form.
    chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
    assert torch.equal(warp_sample(chw, region)["image"], got)
    batch = warp_batch(chw[None], [region], dtype=torch.float32)["image"][0]
    assert (batch - want).abs().max() <= 0.01


def test_pad_crop_region_pads_with_zeros_and_ignore_index():
    image = np.full((6, 8, 3), 200, np.uint8)
    mask = np.arange(48, dtype=np.uint8).reshape(6, 8)
    region = Region((-2.0, 1.0, 6.0, 7.0), False, (6, 8))  # 2 columns left, 1 row below
    # past the image's left edge (into the padding); past its right edge (cut off by the crop)
    boxes = np.array([[-3, 2, 4, 5], [7, 0, 9, 3]], np.float32)
    out = warp_sample(image, region, mask=mask, ignore_index=99, boxes=boxes)
    # clipped to the image before the map: the padding holds no part of a box
    assert out["boxes"].tolist() == [[2.0, 1.0, 6.0, 4.0]]
    assert (out["image"][:, :, :2] == 0).all() and (out["image"][:, 5:] == 0).all()
    assert (out["image"][:, :5, 2:] == 200).all()
    want = np.full((6, 8), 99)
    want[:5, 2:] = mask[1:6, 0:6]
    assert out["mask"].tolist() == want.tolist() and out["mask"].dtype == torch.int64


def test_uint16_masks_and_float_batches():
    mask = torch.arange(12 * 10, dtype=torch.int32).reshape(1, 12, 10).to(torch.uint16) * 500
    images = torch.randint(0, 256, (1, 3, 12, 10), dtype=torch.uint8)
    region = Region((0.0, 0.0, 10.0, 12.0), False, (24, 20))  # 2x nearest upscale
    out = warp_batch(images, [region], masks=mask, dtype=torch.float32)
    assert out["image"].dtype == torch.float32
    assert torch.equal(
        out["mask"][0], mask[0].to(torch.int64).repeat_interleave(2, 0).repeat_interleave(2, 1)
    )


def test_warp_checks_shapes():
    image = np.zeros((10, 12, 3), np.uint8)
    region = Region((0.0, 0.0, 12.0, 10.0), False, (5, 6))
    with pytest.raises(ValueError, match="mask has shape"):
        warp_sample(image, region, mask=np.zeros((10, 11), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        warp_sample(image.astype(np.float32), region)
    batch = torch.zeros(2, 3, 10, 12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one region per image"):
        warp_batch(batch, [region])
    other = Region((0.0, 0.0, 12.0, 10.0), False, (6, 6))
    with pytest.raises(ValueError, match="share out_hw"):
        warp_batch(batch, [region, other])
    with pytest.raises(ValueError, match="masks have shape"):
        warp_batch(batch, [region, region], masks=torch.zeros(2, 10, 10))
    with pytest.raises(ValueError, match="sample 1: got 1 boxes but 2 box labels"):
        warp_batch(
            batch,
            [region, region],
            boxes=[torch.zeros(0, 4), torch.ones(1, 4)],
            box_labels=[torch.zeros(0), torch.zeros(2)],
        )


@pytest.mark.parametrize("train", [True, False])
def test_photo_regions_match_the_cpu_decoders_crop(train):
    """With the same seeds, the photo preset's regions are the boxes and flips that the cpu
    backend's decode-time geometry draws (fastdata.read.decoders.image), so a worker can warp targets
    for a crop it fused into decoding."""
    from fastdata.read.decoders.image import Geometry, draw_crop

    geometry = Geometry("rrc", 64, flip_p=0.5) if train else Geometry("center", 64)
    sizes = [(480, 640), (333, 500), (64, 64), (701, 129), (100, 1000)]
    seeds = list(range(100, 105))
    regions = draw_regions(get_preset("photo", 64), train, sizes, (64, 64), 0, seeds=seeds)
    for (h, w), seed, region in zip(sizes, seeds, regions, strict=True):
        box, flip = draw_crop((w, h), geometry, np.random.default_rng(seed))
        assert region.box == tuple(float(v) for v in box) and region.flip == flip


def test_mask_samples_the_pixel_under_each_output_centre():
    """Nearest is "nearest-exact": output pixel i reads source floor((i + 0.5) * scale)."""
    mask = torch.arange(8 * 12, dtype=torch.int64).reshape(1, 8, 12)
    images = torch.zeros(1, 3, 8, 12, dtype=torch.uint8)
    down = Region((0.0, 0.0, 12.0, 8.0), False, (4, 4))  # x / 3, y / 2
    out = warp_batch(images, [down], masks=mask)["mask"][0]
    assert torch.equal(out, mask[0, 1::2, 1::3])
    up = Region((2.0, 2.0, 6.0, 4.0), True, (6, 10))  # 2.5x wider, 3x taller, mirrored
    out = warp_sample(images[0], up, mask=mask[0])["mask"]
    rows = [2 + int((i + 0.5) * 2 / 6) for i in range(6)]
    cols = [2 + int((9 - j + 0.5) * 4 / 10) for j in range(10)]
    assert out.tolist() == mask[0][rows][:, cols].tolist()


def test_float_noise_at_an_edge_pulls_in_no_padding():
    """A box edge a hair past the image (as float arithmetic may leave it) is taken as on it."""
    image = torch.full((1, 3, 10, 15), 200, dtype=torch.uint8)
    noisy = Region((-1e-5, 0.0, 15.0 + 1e-5, 10.0), False, (4, 7))  # float32-sized noise
    out = warp_batch(image, [noisy], masks=torch.ones(1, 10, 15, dtype=torch.uint8))
    assert (out["image"] == 200).all()
    assert (out["mask"] == 1).all()


# The docs' "Targets that move with the image" example, verbatim (docs/guides/transforms.md).
def _readme_example() -> str:
    """The `warp_sample` / `warp_batch` example of docs/guides/transforms.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "transforms.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "warp_batch(" in b]
    assert len(blocks) == 1, "the transforms page has one warp_batch example"
    return blocks[0]


def test_readme_example_runs(capsys):
    exec(compile(_readme_example(), "README-targets", "exec"), {"__name__": "__readme__"})
    assert "torch.Size([3, 224, 224]) torch.Size([224, 224])" in capsys.readouterr().out
