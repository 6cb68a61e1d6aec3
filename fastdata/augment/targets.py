"""Geometry that moves targets with the image: one `Region` per sample, applied to image, mask, boxes.

A `Region` is a sample's whole geometric augmentation folded into one map: a crop box
``(x0, y0, x1, y1)`` in the source image's pixel coordinates (it may extend past the image: a
pad-crop's zero padding), a horizontal flip after the crop, and the output ``(H, W)``. Output pixel
``(i, j)`` has its centre at source ``(y0 + (i + 0.5) * sy, x0 + (j' + 0.5) * sx)`` with
``sy = (y1 - y0) / H``, ``sx = (x1 - x0) / W`` and ``j' = W - 1 - j`` when flipped, else ``j``.

- **image**: the source, zero-extended past its edges, cropped to the box and resized bilinearly,
  antialiased when shrinking (the triangle filter of PIL and ``F.interpolate(antialias=True)``,
  taps restricted to the box: "pad, crop, then resize", as torchvision's ``RandomCrop(padding=)``
  and ``resized_crop``); pixels outside the image are 0.
- **mask**: nearest: the source pixel under each output pixel's centre (``floor`` of the
  coordinates above, the "nearest-exact" convention); outside the image it is `ignore_index`.
- **boxes**: xyxy pixel boxes clipped to the source image, mapped by the same affine map
  (``x' = (x - x0) / sx``, mirrored as ``W - x'``), clipped to the output; a box left with no
  area is dropped with its label.

`draw_regions` draws the regions of a batch from a `Preset`'s ops with one numpy generator per
sample seeded ``image_seed(batch_seed, i)`` (or the caller's seeds). `warp_sample` applies a region
to one sample on the CPU (a DataLoader worker, at decode time); `warp_batch` applies a batch of
regions on the batch's device (two batched matrix products for the images, one gather for the
masks) and gives `warp_sample`'s result (images within one grey level, masks and boxes equal).

Why not torchvision.transforms.v2 (whose tv_tensors move masks and boxes too, and which a user
can still call on a whole sample): v2 draws one set of parameters per call, so a batch on the
device needs a Python loop over samples; torchvision is not in the CPU environment fastdata
installs; and a worker (decode time) and the device (resident split) must apply the *same*
region, drawn from the plan's seed, which `Region` carries between them. For a whole-pixel box
the images equal v2's ``resized_crop`` + ``horizontal_flip`` (both are torch's antialiased
bilinear); masks differ: v2's NEAREST samples ``floor(i * scale)``, half a pixel off the image,
where this module samples the pixel under each output centre.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from fastdata.augment.params import center_crop_box, rrc_params
from fastdata.augment.presets import (
    BatchTransform,
    Flip,
    Op,
    PadCrop,
    Preset,
    RandomResizedCrop,
    ResizeCenterCrop,
    image_seed,
)
from fastdata.augment.region import Box, Region
from fastdata.augment.warp import (
    as_chw,
    box_params,
    check_boxes,
    fast_image,
    gatherable,
    map_boxes,
    warp_box_lists,
    warp_images,
    warp_masks,
)

__all__ = ["Region", "cover_region", "draw_regions", "warp_batch", "warp_boxes", "warp_sample"]


# ----------------------------------------------------------------------------- drawing
def _canvas_box(region: tuple[Box, bool], hw: tuple[int, int], sub: Box) -> tuple[Box, bool]:
    """Compose: `sub` (x0, y0, x1, y1) in the current canvas of size `hw` -> a source box."""
    (x0, y0, x1, y1), flip = region
    h, w = hw
    sx, sy = (x1 - x0) / w, (y1 - y0) / h
    a, b, c, d = sub
    top, bottom = y0 + b * sy, y0 + d * sy
    if flip:  # canvas column u sits at source x1 - u * sx
        return (x1 - c * sx, top, x1 - a * sx, bottom), flip
    return (x0 + a * sx, top, x0 + c * sx, bottom), flip


def _draw_one(
    ops: Sequence[Op],
    size: tuple[int, int],
    out_hw: tuple[int, int],
    rng: np.random.Generator,
    preset_name: str,
    allow_custom: bool,
) -> Region:
    """Fold `ops` into one region of an image of `size` (H, W), drawing from `rng` in op order."""
    h, w = size
    state: tuple[Box, bool] = ((0.0, 0.0, float(w), float(h)), False)
    hw = (h, w)
    for op in ops:
        if isinstance(op, RandomResizedCrop):
            top, left, bh, bw = rrc_params(hw[0], hw[1], op.scale, op.ratio, rng)
            state, hw = _canvas_box(state, hw, (left, top, left + bw, top + bh)), out_hw
        elif isinstance(op, ResizeCenterCrop):
            top, left, bh, bw = center_crop_box(hw[0], hw[1], out_hw, op.ratio)
            state, hw = _canvas_box(state, hw, (left, top, left + bw, top + bh)), out_hw
        elif isinstance(op, PadCrop):
            dy, dx = (int(rng.integers(0, 2 * op.pad + 1)) for _ in range(2))
            sub = (dx - op.pad, dy - op.pad, dx - op.pad + hw[1], dy - op.pad + hw[0])
            state = _canvas_box(state, hw, sub)
            if op.flip_p > 0 and rng.random() < op.flip_p:
                state = (state[0], not state[1])
        elif isinstance(op, Flip):
            if op.p > 0 and rng.random() < op.p:
                state = (state[0], not state[1])
        elif isinstance(op, BatchTransform) and allow_custom:
            continue
        else:
            name = getattr(op, "name", type(op).__name__)
            raise ValueError(
                f"preset {preset_name!r}: op {name!r} cannot move masks or boxes with the image; "
                "use the geometric ops (RandomResizedCrop, PadCrop, Flip, ResizeCenterCrop), or "
                "pass allow_custom=True and apply the callable to the warped sample yourself"
            )
    # Whole source pixels (single ops give them already; composed ops are rounded): the worker's
    # fast uint8 path applies, and every tap of the resize is a whole pixel of the crop.
    x0, y0, x1, y1 = (float(round(v)) for v in state[0])
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    return Region((x0, y0, x1, y1), state[1], (int(out_hw[0]), int(out_hw[1])))


def draw_regions(
    preset: Preset,
    train: bool,
    sizes: Sequence[tuple[int, int]],
    out_hw: tuple[int, int],
    batch_seed: int,
    *,
    seeds: Sequence[int] | None = None,
    allow_custom: bool = False,
) -> list[Region]:
    """The region of every sample of a batch, drawn from the preset's train or eval ops.

    Sample i draws from ``np.random.default_rng(image_seed(batch_seed, i))`` (or ``seeds[i]``),
    op by op in order: `RandomResizedCrop` -> an `rrc_params` box (torchvision semantics),
    `PadCrop` -> offsets ``dy``, ``dx`` uniform in ``[0, 2 * pad]`` (a box extending up to `pad`
    past the image), then its flip; `Flip` -> a flip with its p; `ResizeCenterCrop` -> the centred
    box of the output's aspect, ``1 / ratio`` of the shorter side (no draws). The last canvas is
    resized to `out_hw`: no ops (evaluation of most presets, preset "none") is the whole image
    resized to `out_hw`, no flip.

    Args:
        preset: the augmentation preset.
        train: use its train ops (True) or its eval ops (False).
        sizes: per-sample source ``(H, W)``.
        out_hw: output ``(H, W)`` of every sample.
        batch_seed: the batch's seed.
        seeds: per-sample seeds instead of ``image_seed(batch_seed, i)``.
        allow_custom: skip `BatchTransform` ops (the caller applies them to the warped sample)
            instead of raising.

    Raises:
        ValueError: a size or out_hw is not positive, `seeds` has the wrong length, or an op cannot
            move targets (a user's callable, unless `allow_custom`).
    """
    if len(out_hw) != 2 or min(out_hw) < 1:
        raise ValueError(f"out_hw must be two positive ints, got {out_hw}")
    if seeds is not None and len(seeds) != len(sizes):
        raise ValueError(f"need one seed per sample, got {len(seeds)} seeds for {len(sizes)} sizes")
    ops = preset.ops(train)
    regions = []
    for i, (h, w) in enumerate(sizes):
        if h < 1 or w < 1:
            raise ValueError(f"sample {i} has size {(h, w)}: sizes must be positive (H, W)")
        seed = seeds[i] if seeds is not None else image_seed(batch_seed, i)
        rng = np.random.default_rng(seed)
        regions.append(_draw_one(ops, (int(h), int(w)), out_hw, rng, preset.name, allow_custom))
    return regions


def cover_region(in_hw: tuple[int, int], out_hw: tuple[int, int]) -> Region:
    """The region of a resize that just covers `out_hw`, keeping the centre window.

    The geometry of the "cover" decode (`fastdata.read.decoders.image.Geometry("cover")`: how the memory
    backend and the decoded cache store photos at `stored_hw`), so a sample's mask and boxes can
    be stored the way its image is; the box is fractional when the aspects differ.

    Args:
        in_hw: the source ``(H, W)``.
        out_hw: the stored ``(H, W)``.
    """
    (h, w), (th, tw) = in_hw, out_hw
    if min(h, w, th, tw) < 1:
        raise ValueError(f"cover_region needs positive sizes, got {in_hw} -> {out_hw}")
    cover = max(tw / w, th / h)  # the formula of decode._cover
    box = ((w - tw / cover) / 2, (h - th / cover) / 2, (w + tw / cover) / 2, (h + th / cover) / 2)
    # float noise off a whole pixel (15 - 21 / 1.4 = -2e-15) snaps back to it
    snapped = tuple(float(round(v)) if abs(v - round(v)) < 1e-9 else v for v in box)
    return Region(snapped, False, (int(th), int(tw)))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- boxes
def warp_boxes(
    boxes: Tensor | np.ndarray,
    box_labels: Tensor | np.ndarray | None,
    region: Region,
    in_hw: tuple[int, int],
) -> tuple[Tensor, Tensor | None]:
    """Move xyxy pixel boxes by `region`: clip to the source, map, clip to the output, drop empty.

    Computed in float64 on the boxes' device, returned as float32; a box whose width or height is
    0 after clipping (e.g. one the crop missed) is dropped together with its label.

    Args:
        boxes: ``(k, 4)`` xyxy boxes in source pixels.
        box_labels: ``(k,)`` classes, or None.
        region: the sample's region.
        in_hw: the source image's ``(H, W)``.

    Returns:
        (float32 ``(k', 4)`` boxes in output pixels, int64 ``(k',)`` labels or None).

    Raises:
        ValueError: boxes not of shape (k, 4), or labels of another length.
    """
    b, labels = check_boxes(boxes, box_labels, "")
    params = torch.tensor([box_params(region, in_hw)], dtype=torch.float64, device=b.device)
    out, keep = map_boxes(b, params.expand(b.shape[0], -1))
    return out[keep], None if labels is None else labels[keep]


# ----------------------------------------------------------------------------- public warps
def warp_sample(
    image: np.ndarray | Tensor,
    region: Region,
    *,
    mask: np.ndarray | Tensor | None = None,
    boxes: np.ndarray | Tensor | None = None,
    box_labels: np.ndarray | Tensor | None = None,
    ignore_index: int = 255,
    layout: str | None = None,
    antialias: bool = True,
) -> dict[str, Tensor]:
    """Apply `region` to one sample on the CPU (a DataLoader worker, at decode time).

    Args:
        image: uint8 HWC or CHW image (numpy arrays default to HWC, tensors to CHW when the
            shape leaves a doubt; `layout` says which).
        region: the sample's region.
        mask: ``(H, W)`` integer map of the image's size.
        boxes: ``(k, 4)`` xyxy boxes in source pixels.
        box_labels: ``(k,)`` box classes.
        ignore_index: the mask value of output pixels outside the image.
        layout: "HWC" or "CHW"; None guesses from the type and shape.
        antialias: low-pass when shrinking (PIL, torchvision).

    Returns:
        ``{"image": uint8 (C, H', W')}`` plus, for the targets given, ``"mask"`` int64
        ``(H', W')``, ``"boxes"`` float32 ``(k', 4)``, ``"box_labels"`` int64 ``(k',)``.

    Raises:
        ValueError: shapes that do not fit (a mask of another size than the image, ...).
    """
    chw = as_chw(image, layout)
    if chw.dtype != torch.uint8:
        raise ValueError(f"image must be uint8, got {chw.dtype}")
    h, w = chw.shape[1:]
    if region.integral and antialias:
        out = {"image": fast_image(chw, region)}
    else:
        out = {"image": warp_images(chw[None], [region], antialias, torch.uint8)[0]}
    if mask is not None:
        m = torch.as_tensor(mask)
        if tuple(m.shape) != (h, w):
            raise ValueError(
                f"mask has shape {tuple(m.shape)}, the image is {h}x{w}: they must match"
            )
        out["mask"] = warp_masks(gatherable(m)[None], [region], ignore_index)[0]
    if boxes is not None:
        kept, labels = warp_boxes(boxes, box_labels, region, (h, w))
        out["boxes"] = kept
        if labels is not None:
            out["box_labels"] = labels
    return out


def warp_batch(
    images: Tensor,
    regions: Sequence[Region],
    *,
    masks: Tensor | None = None,
    boxes: Sequence[Tensor] | None = None,
    box_labels: Sequence[Tensor] | None = None,
    ignore_index: int = 255,
    antialias: bool = True,
    dtype: torch.dtype = torch.uint8,
) -> dict[str, Tensor | list[Tensor]]:
    """Apply per-sample regions to a batch on its device: `warp_sample` of every sample, batched.

    Images: two batched matrix products with per-sample resize weights (no per-sample loop, no
    host sync); masks: one gather; boxes: one vectorized map, split per sample (one sync).

    Args:
        images: uint8 ``(N, C, H, W)`` batch (float on the 0..255 scale also works).
        regions: one region per sample, all with the same `out_hw`.
        masks: ``(N, H, W)`` integer maps.
        boxes: per-sample ``(k_i, 4)`` xyxy boxes in source pixels.
        box_labels: per-sample ``(k_i,)`` classes.
        ignore_index: the mask value of output pixels outside the image.
        antialias: low-pass when shrinking.
        dtype: uint8 (rounded, `warp_sample`'s pixels within one grey level) or a float dtype
            (0..255 scale, not rounded: for normalization straight after).

    Returns:
        ``{"image": (N, C, H', W')}`` plus, for the targets given, ``"mask"`` int64
        ``(N, H', W')``, ``"boxes"`` and ``"box_labels"`` lists of per-sample tensors.

    Raises:
        ValueError: a count or shape that does not fit.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
    n, _, h, w = images.shape
    if len(regions) != n:
        raise ValueError(f"need one region per image, got {len(regions)} for {n} images")
    if n == 0:
        raise ValueError("warp_batch needs at least one image")
    if len({r.out_hw for r in regions}) > 1:
        raise ValueError(
            f"regions of one batch must share out_hw, got {sorted({r.out_hw for r in regions})}"
        )
    out: dict[str, Tensor | list[Tensor]] = {
        "image": warp_images(images, regions, antialias, dtype)
    }
    if masks is not None:
        if tuple(masks.shape) != (n, h, w):
            raise ValueError(f"masks have shape {tuple(masks.shape)}, expected {(n, h, w)}")
        out["mask"] = warp_masks(gatherable(masks), regions, ignore_index)
    if boxes is not None:
        out.update(warp_box_lists(boxes, box_labels, regions, (h, w)))
    return out
