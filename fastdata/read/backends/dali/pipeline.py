"""DALI graphs of the presets' typed ops: encoded or raw samples -> augmented uint8 CHW images.

`build_graph` reads the preset's ops (never its name): a single `PadCrop` (the cifar graph), a
`RandomResizedCrop` optionally followed by a `Flip` (decode-and-crop), a `ResizeCenterCrop`, or no
op. Other ops (user callables among them) cannot run inside a DALI graph: ValueError. The
semantics are those of `fastdata.augment`. The graph runs every op of the preset but not the
normalization: its images are uint8, as every backend's (`ShardDataModule.on_after_batch_transfer`
normalizes them on the training device). `nvidia.dali` is imported inside the builders only, so
importing this module never needs DALI.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdata.augment import Flip, PadCrop, RandomResizedCrop, ResizeCenterCrop
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders.image import stored_hw

__all__ = ["GRAPHS", "build_graph"]


@dataclass(frozen=True)
class _Graph:
    """What the preset graphs need to know; fixed for the life of the loader."""

    kind: str  # a key of GRAPHS
    train: bool
    encoding: str
    raw_shape: tuple[int, int, int] | None
    size: tuple[int, int]  # output (H, W)
    gpu: bool
    op: Any = None  # the fused op (PadCrop, RandomResizedCrop, ResizeCenterCrop) or None
    flip_p: float = 0.0

    @property
    def decoder_device(self) -> str:
        return "mixed" if self.gpu else "cpu"

    @property
    def op_device(self) -> str:
        return "gpu" if self.gpu else "cpu"


def _decode(data: Any, g: _Graph) -> Any:
    """Encoded bytes or raw pixels -> uint8 HWC on the graph's device."""
    from nvidia.dali import fn, types

    if g.encoding == "raw":
        images = fn.reshape(data, shape=list(g.raw_shape), layout="HWC")
        return images.gpu() if g.gpu else images
    return fn.decoders.image(data, device=g.decoder_device, output_type=types.RGB)


def _finish(images: Any, g: _Graph, **crop: Any) -> Any:
    """The last crop and the flip, to uint8 CHW (no normalization: the DataModule's)."""
    from nvidia.dali import fn, types

    mirror = fn.random.coin_flip(probability=g.flip_p) if g.flip_p > 0 else 0
    return fn.crop_mirror_normalize(
        images,
        device=g.op_device,
        dtype=types.UINT8,
        output_layout="CHW",
        mirror=mirror,
        **crop,
    )


def _cover(images: Any, g: _Graph) -> Any:
    """Resize to just cover the output size and keep the centre window (the decoder's "cover")."""
    from nvidia.dali import fn

    if g.raw_shape is not None and g.size == g.raw_shape[:2]:
        return images  # every image already has the output size
    h, w = g.size
    images = fn.resize(images, device=g.op_device, size=[h, w], mode="not_smaller")
    return fn.crop(images, device=g.op_device, crop=(h, w))


def _cifar_graph(data: Any, g: _Graph) -> Any:
    from nvidia.dali import fn

    images = _cover(_decode(data, g), g)
    h, w = g.size
    pad = g.op.pad
    # A centred (H + 8) x (W + 8) window of an H x W image starts at -4: zero padding on each side.
    padded = fn.crop(
        images,
        device=g.op_device,
        crop=(h + 2 * pad, w + 2 * pad),
        out_of_bounds_policy="pad",
        fill_values=0,
    )
    # crop_pos p places the window at p * (padded - crop) = p * 2 * pad: p = k / (2 * pad) gives
    # the integer offset k, uniform over 0..2 * pad like `augment.random_crop_with_padding`.
    offsets = [k / (2 * pad) for k in range(2 * pad + 1)]
    return _finish(
        padded,
        g,
        crop=(h, w),
        crop_pos_x=fn.random.uniform(values=offsets),
        crop_pos_y=fn.random.uniform(values=offsets),
    )


def _rrc_graph(data: Any, g: _Graph) -> Any:
    from nvidia.dali import fn, types

    h, w = g.size
    area, ratio = list(g.op.scale), list(g.op.ratio)
    if g.encoding == "raw":
        images = fn.random_resized_crop(
            _decode(data, g),
            device=g.op_device,
            size=[h, w],
            random_area=area,
            random_aspect_ratio=ratio,
        )
        return _finish(images, g)
    # Fused decode + crop: only the crop window's part of the JPEG is decoded.
    images = fn.decoders.image_random_crop(
        data,
        device=g.decoder_device,
        output_type=types.RGB,
        random_area=area,
        random_aspect_ratio=ratio,
        num_attempts=10,
    )
    images = fn.resize(images, device=g.op_device, resize_y=h, resize_x=w)
    return _finish(images, g)


def _center_graph(data: Any, g: _Graph) -> Any:
    from nvidia.dali import fn

    h, w = g.size
    # floor(S * ratio) like `augment.center_crop_params` (the epsilon keeps 224 -> 256).
    shorter = math.floor(min(h, w) * g.op.ratio + 1e-6)
    images = fn.resize(_decode(data, g), device=g.op_device, resize_shorter=shorter)
    return _finish(images, g, crop=(h, w))


def _plain_graph(data: Any, g: _Graph) -> Any:
    return _finish(_cover(_decode(data, g), g), g)


#: Graph kind -> builder ``(encoded or raw sample, _Graph) -> uint8 CHW images``.
GRAPHS: dict[str, Callable[[Any, _Graph], Any]] = {
    "pad_crop": _cifar_graph,
    "rrc": _rrc_graph,
    "center": _center_graph,
    "plain": _plain_graph,
}


def _kind(spec: LoaderSpec) -> tuple[str, Any, float]:
    """(graph kind, fused op, flip probability) of the preset's ops for the split."""
    preset, ops = spec.preset, spec.preset.ops(spec.train)
    if not ops:
        return "plain", None, 0.0
    if (pad := preset.pad_crop(spec.train)) is not None:
        return "pad_crop", pad, pad.flip_p
    crop, flip_p, covered = preset.decode_crop(spec.train)
    if crop is not None and covered == len(ops):
        return ("rrc" if isinstance(crop, RandomResizedCrop) else "center"), crop, flip_p
    names = ", ".join(type(op).__name__ for op in ops)
    supported = ", ".join(t.__name__ for t in (PadCrop, RandomResizedCrop, Flip, ResizeCenterCrop))
    raise ValueError(
        f"the dali backend fuses decoding and augmentation into one DALI graph and cannot run "
        f"the ops [{names}] (it runs {supported} as the built-in presets use them); use "
        "backend='cpu' or 'memory', which hand uint8 batches to your transform"
    )


def build_graph(spec: LoaderSpec, gpu: bool) -> Callable[[Any], Any]:
    """The DALI graph of the split: ``images = graph(data)`` inside a pipeline definition."""
    kind, op, flip_p = _kind(spec)
    info = spec.manifest.split(spec.split)
    raw_shape = tuple(int(v) for v in info.raw_shape) if info.raw_shape else None
    if info.encoding == "raw" and (raw_shape is None or raw_shape[2] != 3):
        raise ValueError(
            f"split {spec.split!r} is raw but its raw_shape is {info.raw_shape}; re-run `fastdata shard`"
        )
    if kind in ("rrc", "center"):
        size = (spec.preset.image_size,) * 2
    else:
        # ValueError for photos of varying size
        size = stored_hw(info, spec.image_size, margin=spec.preset.resizes(spec.train))
    graph = _Graph(
        kind,
        spec.train,
        info.encoding,
        raw_shape,
        tuple(size),
        gpu,
        op,
        flip_p,
    )
    return lambda data: GRAPHS[kind](data, graph)
