"""DALI graph builders of the presets: encoded or raw samples -> normalized float CHW images.

The preset semantics (those of `fastdata.augment`) are listed in the `fastdata.read.dali` package
docstring. `nvidia.dali` is imported inside the builders only, so importing this module never
needs DALI.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdata.augment import get_preset
from fastdata.read.base import LoaderSpec

__all__ = ["GRAPHS"]

_EXTS = {"raw": "rgb", "png": "png", "jpeg": "jpg", "mixed": "jpg;png"}
_RRC_AREA = (0.08, 1.0)
_RRC_RATIO = (3 / 4, 4 / 3)
_EVAL_RESIZE_RATIO = 256 / 224
_CIFAR_PAD = 4


@dataclass(frozen=True)
class _Graph:
    """What the preset graphs need to know; fixed for the life of the loader."""

    preset: str
    train: bool
    encoding: str
    raw_shape: tuple[int, int, int] | None
    size: tuple[int, int]  # output (H, W)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    gpu: bool

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


def _normalize(images: Any, g: _Graph, **crop: Any) -> Any:
    from nvidia.dali import fn, types

    mirror = fn.random.coin_flip(probability=0.5) if g.train else 0
    return fn.crop_mirror_normalize(
        images,
        device=g.op_device,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=list(g.mean),
        std=list(g.std),
        mirror=mirror,
        **crop,
    )


def _resize_to(images: Any, g: _Graph) -> Any:
    from nvidia.dali import fn

    if g.raw_shape is not None and g.size == g.raw_shape[:2]:
        return images  # every image already has the output size
    return fn.resize(images, device=g.op_device, resize_y=g.size[0], resize_x=g.size[1])


def _cifar_graph(data: Any, g: _Graph) -> Any:
    from nvidia.dali import fn

    images = _resize_to(_decode(data, g), g)
    if not g.train:
        return _normalize(images, g)
    h, w = g.size
    pad = _CIFAR_PAD
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
    return _normalize(
        padded,
        g,
        crop=(h, w),
        crop_pos_x=fn.random.uniform(values=offsets),
        crop_pos_y=fn.random.uniform(values=offsets),
    )


def _photo_graph(data: Any, g: _Graph) -> Any:
    from nvidia.dali import fn, types

    h, w = g.size
    if g.train:
        if g.encoding == "raw":
            images = fn.random_resized_crop(
                _decode(data, g),
                device=g.op_device,
                size=[h, w],
                random_area=list(_RRC_AREA),
                random_aspect_ratio=list(_RRC_RATIO),
            )
            return _normalize(images, g)
        # Fused decode + crop: only the crop window's part of the JPEG is decoded.
        images = fn.decoders.image_random_crop(
            data,
            device=g.decoder_device,
            output_type=types.RGB,
            random_area=list(_RRC_AREA),
            random_aspect_ratio=list(_RRC_RATIO),
            num_attempts=10,
        )
        images = fn.resize(images, device=g.op_device, resize_y=h, resize_x=w)
        return _normalize(images, g)
    # floor(S * 256 / 224) like `augment.center_crop_params` (the epsilon keeps 224 -> 256).
    shorter = math.floor(min(h, w) * _EVAL_RESIZE_RATIO + 1e-6)
    images = fn.resize(_decode(data, g), device=g.op_device, resize_shorter=shorter)
    return _normalize(images, g, crop=(h, w))


def _plain_graph(data: Any, g: _Graph) -> Any:
    return _normalize(_resize_to(_decode(data, g), g), g)


#: Preset name -> graph builder ``(encoded or raw sample, _Graph) -> float CHW images``.
GRAPHS: dict[str, Callable[[Any, _Graph], Any]] = {
    "cifar": _cifar_graph,
    "photo": _photo_graph,
    "none": _plain_graph,
}


def _graph(spec: LoaderSpec, gpu: bool) -> _Graph:
    if spec.preset not in GRAPHS:
        raise ValueError(f"the dali backend has presets {sorted(GRAPHS)}, got {spec.preset!r}")
    info = spec.manifest.split(spec.split)
    if info.encoding not in _EXTS:
        raise ValueError(f"split {spec.split!r} has an unknown encoding {info.encoding!r}")
    raw_shape = tuple(int(v) for v in info.raw_shape) if info.raw_shape else None
    if info.encoding == "raw" and (raw_shape is None or raw_shape[2] != 3):
        raise ValueError(
            f"split {spec.split!r} is raw but its raw_shape is {info.raw_shape}; re-run `fastdata shard`"
        )
    preset = get_preset(spec.preset)  # mean / std (and photo's default size) of fastdata.augment
    size: Any = spec.image_size
    if isinstance(size, int):
        size = (size, size)
    if size is None and preset.image_size is not None:
        size = (preset.image_size, preset.image_size)
    if size is None and raw_shape is None:
        raise ValueError(
            f"split {spec.split!r} holds {info.encoding} images of varying size: pass image_size"
        )
    size = tuple(int(v) for v in (size or raw_shape[:2]))
    if min(size) < 1:
        raise ValueError(f"image_size must be positive, got {spec.image_size!r}")
    return _Graph(
        spec.preset, spec.train, info.encoding, raw_shape, size, preset.mean, preset.std, gpu
    )
