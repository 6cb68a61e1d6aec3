"""Property tests of fastdata.augment.targets: a solid rectangle's box and mask follow its pixels.

Each source image is a background colour with one solid rectangle of another colour at a random
place; the rectangle's box is the detection target and its pixels the segmentation mask. After a
region is applied, the fraction of the rectangle's colour in every output pixel is solved from the
pixel itself (the output is a mix of the colour, the background and the zero padding), so the test
reads the geometry from the image and checks that the warped box and mask say the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fastdata.augment import (
    Flip,
    PadCrop,
    Preset,
    RandomResizedCrop,
    ResizeCenterCrop,
    draw_regions,
    get_preset,
    warp_batch,
    warp_sample,
)

CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.gpu,
)
COLOUR = np.array([230.0, 30.0, 200.0])
BACKGROUND = np.array([40.0, 160.0, 70.0])
CLASS, DECOY, IGNORE = 5, 9, 255
_UNMIX = np.linalg.pinv(np.stack([COLOUR, BACKGROUND], axis=1))  # (2, 3): pixel -> fractions


def _preset(ops: tuple, eval_ops: tuple = ()) -> Preset:
    return Preset("test", 64, (0.0,) * 3, (1.0,) * 3, ops, eval_ops)


# (name, preset, train): every geometric op, train and eval, and crops that often miss.
CASES = [
    ("rrc+flip (photo train)", get_preset("photo", 64), True),
    ("centre crop (photo eval)", get_preset("photo", 64), False),
    ("pad-crop+flip (cifar train)", get_preset("cifar"), True),
    ("resize (cifar eval)", get_preset("cifar"), False),
    ("resize (none train)", get_preset("none"), True),
    ("resize (none eval)", get_preset("none"), False),
    ("flip always", _preset((Flip(1.0),)), True),
    ("big pad-crop", _preset((PadCrop(pad=40, flip_p=0.5),)), True),
    ("small rrc", _preset((RandomResizedCrop(scale=(0.01, 0.05)), Flip(0.5))), True),
    ("rrc then pad-crop", _preset((RandomResizedCrop(), PadCrop(pad=6, flip_p=0.5))), True),
    ("wide centre crop", _preset((), (ResizeCenterCrop(ratio=1.5),)), False),
]
OUT_SIZES = [(64, 64), (47, 81), (90, 33)]
SAMPLE_SEEDS, BATCH_SEEDS = 36, 6  # per case; raise them to search further (all pass at 400, 40)


@dataclass
class Scene:
    image: np.ndarray  # (H, W, 3) uint8
    mask: np.ndarray  # (H, W) uint8: CLASS on the rectangle, 0 elsewhere
    box: np.ndarray  # (2, 4) float32 xyxy: the rectangle's and a decoy's, in random order
    labels: np.ndarray  # (2,) int64: CLASS for the rectangle, DECOY for the other box


def _scene(rng: np.random.Generator, h: int, w: int, style: int) -> Scene:
    """A background image with one rectangle: 0 random, 1 one pixel, 2 touching the border.

    The targets also hold a decoy box of background somewhere else, before or after the
    rectangle's, so a label that does not follow its box (when the other is dropped) shows.
    """
    if style == 1:
        rh = rw = 1
    else:
        rh, rw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
    y0, x0 = int(rng.integers(0, h - rh + 1)), int(rng.integers(0, w - rw + 1))
    if style == 2:  # push it against one or two borders
        y0 = 0 if rng.random() < 0.5 else h - rh
        x0 = 0 if rng.random() < 0.5 else (w - rw if rng.random() < 0.5 else x0)
    image = np.empty((h, w, 3), np.uint8)
    image[:] = BACKGROUND.astype(np.uint8)
    image[y0 : y0 + rh, x0 : x0 + rw] = COLOUR.astype(np.uint8)
    mask = np.zeros((h, w), np.uint8)
    mask[y0 : y0 + rh, x0 : x0 + rw] = CLASS
    dh, dw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
    dy, dx = int(rng.integers(0, h - dh + 1)), int(rng.integers(0, w - dw + 1))
    boxes = [[x0, y0, x0 + rw, y0 + rh], [dx, dy, dx + dw, dy + dh]]
    labels = [CLASS, DECOY]
    if rng.random() < 0.5:
        boxes, labels = boxes[::-1], labels[::-1]
    return Scene(image, mask, np.array(boxes, np.float32), np.array(labels, np.int64))


def _fractions(image: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per output pixel: (fraction of the rectangle's colour, fraction of the background)."""
    pixels = image.cpu().numpy().astype(np.float64).transpose(1, 2, 0)  # (H, W, 3)
    mix = pixels @ _UNMIX.T
    return mix[..., 0], mix[..., 1]


def _edge_distance(hw: tuple[int, int], box: np.ndarray | None) -> np.ndarray:
    """Distance of each output pixel's centre from the nearest edge of `box` (inf without one)."""
    if box is None:
        return np.full(hw, np.inf)
    ys, xs = np.mgrid[0 : hw[0], 0 : hw[1]] + 0.5
    x0, y0, x1, y1 = box
    inside = np.minimum(np.minimum(xs - x0, x1 - xs), np.minimum(ys - y0, y1 - ys))
    out_x = np.maximum(np.maximum(x0 - xs, xs - x1), 0)
    out_y = np.maximum(np.maximum(y0 - ys, ys - y1), 0)
    return np.where(inside > 0, inside, np.hypot(out_x, out_y))


def _coloured(colour: np.ndarray) -> np.ndarray:
    """The rectangle's pixels: rows and columns whose profile passes half the peak fraction."""
    peak = colour.max()
    if peak < 0.05:
        return np.zeros(colour.shape, bool)
    cols, rows = colour.max(axis=0) > 0.5 * peak, colour.max(axis=1) > 0.5 * peak
    return rows[:, None] & cols[None, :]


def _footprint(region, in_hw: tuple[int, int]) -> np.ndarray:
    """Where the source image lands in the output (xyxy), by the region's affine map."""
    (x0, y0, x1, y1), (oh, ow) = region.box, region.out_hw
    fx, fy = ow / (x1 - x0), oh / (y1 - y0)
    left, right = -x0 * fx, (in_hw[1] - x0) * fx
    if region.flip:
        left, right = ow - right, ow - left
    return np.array([left, -y0 * fy, right, (in_hw[0] - y0) * fy])


def check_sample(out: dict, exact: bool, stats: dict, footprint: np.ndarray) -> None:
    """The warped box and mask describe the rectangle's pixels in the warped image.

    A resize is separable, so the colour fraction of output pixel (i, j) is ``fx(j) * fy(i)``:
    the colour's columns are read from the column profile (each column's largest fraction), its
    rows from the row profile; a column or row belongs to the rectangle when its profile passes
    half the peak: for a rectangle wider than the filter, "more than half of the pixel is the
    colour"; for a thinner one, whose pixels never reach a majority, the half-maximum width of
    its smudge. The colour's pixels are those rows times those columns.
    """
    image, mask = out["image"], out["mask"].cpu().numpy()
    boxes, labels = out["boxes"].cpu().numpy(), out["box_labels"].cpu().numpy()
    assert image.dtype == torch.uint8 and mask.dtype == np.int64
    assert boxes.shape[0] == labels.shape[0] <= 2
    assert sorted(labels.tolist()) in ([], [CLASS], [DECOY], [CLASS, DECOY])
    boxes = boxes[labels == CLASS]  # the decoy's box only checks that labels follow boxes
    colour, background = _fractions(image)
    in_mask = mask == CLASS
    peak, coloured = colour.max(), _coloured(colour)
    if boxes.shape[0] == 0:  # the crop missed the rectangle: nothing of it anywhere
        stats["dropped"] += 1
        assert peak < 0.02, "a dropped box's rectangle is still in the image"
        assert not in_mask.any(), "a dropped box's rectangle is still in the mask"
        box = None
    else:
        stats["kept"] += 1
        box = boxes[0].astype(np.float64)
        assert (box[2:] > box[:2]).all()
        if coloured.any():
            ys, xs = np.nonzero(coloured)
            found = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)
            # Within a pixel; a box thinner than a pixel smears over up to two: 1.5 on that axis.
            size = np.tile(box[2:] - box[:2], 2)
            tolerance = 0.0 if exact else np.where(size >= 1.0, 1.0, 1.5) + 1e-6
            assert (np.abs(found - box) <= tolerance).all(), (found, box)
        else:  # only a sub-pixel box can fade below 5 % colour in every output pixel
            assert (box[2] - box[0]) * (box[3] - box[1]) < 0.3, (peak, box)
    # The mask: the colour's pixels (nearest), ignore_index on the zero padding.
    agree = in_mask == coloured
    if exact:
        assert agree.all()
        assert ((mask == IGNORE) == (image.cpu().numpy().max(0) == 0)).all()
        stats["exact"] += 1
    else:
        edge = _edge_distance(mask.shape, box)
        # Nearest sampling decides a pixel by its centre; where an edge of the box runs through
        # the pixel (centre within half a pixel of it) the pixel is partly the colour and either
        # answer is right, and a box thinner than a pixel may fall between two centres.
        assert agree[edge >= 0.5].mean() >= 0.99, agree[edge >= 0.5].mean()
        assert agree[edge >= 1.0].all(), "mask and image disagree away from the box's edges"
        # ignore_index exactly where the image shows the zero padding (same edge rule).
        agree = (mask == IGNORE) == ((colour + background) < 0.5)
        edge = _edge_distance(mask.shape, footprint)
        assert agree[edge >= 0.5].mean() >= 0.99
        assert agree[edge >= 1.0].all(), "ignore_index and the image's padding disagree"
    stats["ignore"] += int((mask == IGNORE).any())


def _exact(region, in_hw: tuple[int, int]) -> bool:
    """No resampling: whole-pixel box of the output's size."""
    x0, y0, x1, y1 = region.box
    return region.integral and (y1 - y0, x1 - x0) == region.out_hw


def _stats() -> dict:
    return dict.fromkeys(("dropped", "kept", "exact", "ignore", "flip"), 0)


@pytest.mark.parametrize(("name", "preset", "train"), CASES, ids=[c[0] for c in CASES])
def test_warp_sample_moves_box_and_mask_with_the_pixels(name, preset, train):
    stats = _stats()
    for seed in range(SAMPLE_SEEDS):
        rng = np.random.default_rng([seed, 20])
        out_hw = OUT_SIZES[seed % len(OUT_SIZES)]
        if "cifar" in name and seed % 2 == 0:  # the cifar shape: no resampling at all
            h = w = out_hw[0] if out_hw[0] == out_hw[1] else 32
            out_hw = (h, w)
        else:
            h, w = (int(v) for v in rng.integers(9, 160, size=2))
        scene = _scene(rng, h, w, style=seed % 3)
        (region,) = draw_regions(preset, train, [(h, w)], out_hw, batch_seed=seed)
        stats["flip"] += region.flip
        out = warp_sample(
            scene.image, region, mask=scene.mask, boxes=scene.box, box_labels=scene.labels
        )
        assert tuple(out["image"].shape) == (3, *out_hw)
        check_sample(out, _exact(region, (h, w)), stats, _footprint(region, (h, w)))
    assert stats["kept"] > 0
    if name.startswith(("small rrc", "big pad")):
        assert stats["dropped"] > 0, "the case must include crops that miss the rectangle"
    if "flip" in name:
        assert stats["flip"] > 0
    if "pad" in name:
        assert stats["ignore"] > 0, "pad-crops must reach past the image"
    if "cifar train" in name:
        assert stats["exact"] > 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("name", "preset", "train"), CASES, ids=[c[0] for c in CASES])
def test_warp_batch_equals_warp_sample(name, preset, train, device):
    stats = _stats()
    for seed in range(BATCH_SEEDS):
        rng = np.random.default_rng([seed, 21])
        h, w = (int(v) for v in rng.integers(9, 130, size=2))
        out_hw = OUT_SIZES[seed % len(OUT_SIZES)]
        scenes = [_scene(rng, h, w, style=i % 3) for i in range(8)]
        regions = draw_regions(preset, train, [(h, w)] * len(scenes), out_hw, batch_seed=seed)
        images = torch.from_numpy(np.stack([s.image for s in scenes])).permute(0, 3, 1, 2)
        masks = torch.from_numpy(np.stack([s.mask for s in scenes]))
        batch = warp_batch(
            images.contiguous().to(device),
            regions,
            masks=masks.to(device),
            boxes=[torch.from_numpy(s.box).to(device) for s in scenes],
            box_labels=[torch.from_numpy(s.labels).to(device) for s in scenes],
        )
        assert batch["image"].device.type == device and batch["image"].dtype == torch.uint8
        for i, (scene, region) in enumerate(zip(scenes, regions, strict=True)):
            one = warp_sample(
                scene.image, region, mask=scene.mask, boxes=scene.box, box_labels=scene.labels
            )
            got = {
                "image": batch["image"][i],
                "mask": batch["mask"][i],
                "boxes": batch["boxes"][i],
                "box_labels": batch["box_labels"][i],
            }
            diff = (got["image"].cpu().int() - one["image"].int()).abs().max()
            assert diff <= 1, f"sample {i}: images differ by {int(diff)} grey levels"
            assert torch.equal(got["mask"].cpu(), one["mask"])
            torch.testing.assert_close(got["boxes"].cpu(), one["boxes"], atol=1e-4, rtol=0)
            assert torch.equal(got["box_labels"].cpu(), one["box_labels"])
            check_sample(got, _exact(region, (h, w)), stats, _footprint(region, (h, w)))
    assert stats["kept"] > 0


@pytest.mark.parametrize("out_hw", [(48, 64), (37, 37), (90, 21)])
def test_cover_region_matches_the_cover_decode(out_hw):
    """The memory backend stores photos with the "cover" decode (Pillow); `cover_region` moves
    the mask and boxes the same way, read back from the Pillow-decoded pixels."""
    import io

    from PIL import Image

    from fastdata.augment import cover_region
    from fastdata.read.decoders.image import Geometry, decode_image

    stats = _stats()
    for seed in range(24):
        rng = np.random.default_rng([seed, 22])
        h, w = (int(v) for v in rng.integers(9, 160, size=2))
        scene = _scene(rng, h, w, style=seed % 3)
        scene.image.flags.writeable = False  # as Pillow's arrays are: no torch warning
        png = io.BytesIO()
        Image.fromarray(scene.image).save(png, format="PNG")
        region = cover_region((h, w), out_hw)
        pixels = decode_image(png.getvalue(), Geometry("cover", hw=out_hw), rng)
        out = warp_sample(
            scene.image, region, mask=scene.mask, boxes=scene.box, box_labels=scene.labels
        )
        out["image"] = torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # Pillow's pixels
        check_sample(out, False, stats, _footprint(region, (h, w)))
    assert stats["kept"] > 0


def test_cover_decode_of_an_image_with_the_output_aspect():
    import io

    from PIL import Image

    from fastdata.read.decoders.image import Geometry, decode_image

    png = io.BytesIO()
    Image.new("RGB", (15, 65)).save(png, format="PNG")
    pixels = decode_image(png.getvalue(), Geometry("cover", hw=(90, 21)), np.random.default_rng(0))
    assert pixels.shape == (90, 21, 3)
