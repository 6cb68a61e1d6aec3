"""Batched augmentation and normalization on the device (torch only), and the presets.

Every kernel takes a whole uint8 (or 0..255 float) batch ``(N, C, H, W)`` and works the same on CPU
and CUDA tensors: no per-sample Python loop, no host sync on the hot path (airbench style: the batch
is augmented where it already lives). Random parameters are drawn apart from the kernels that apply
them (torchvision v2 style), on the device of the ``torch.Generator`` when one is given (else on the
batch's device) and then moved to the batch: a CPU generator with a fixed seed gives the same
augmentation for a CPU batch and for a CUDA batch.

Presets (`get_preset(name)`, typed `Preset` objects; a user's own callable is wrapped as a
`BatchTransform` op, called once per image with its own seed, `image_seed`, or with
``per_sample=False`` once per batch); every backend gives the same semantics:

- ``"cifar"``: train = random 32x32 crop (the input size) of the input zero-padded by 4 pixels on
  every side, offsets ``(dy, dx)`` uniform in ``[0, 8]`` each (torchvision
  ``RandomCrop(32, padding=4)``, zero fill), then horizontal flip with p = 0.5 (fused into the
  crop's gather), then normalize with the dataset's mean/std (else CIFAR-100's). Eval = normalize.
- ``"photo"``: train = random-resized-crop (`RandomResizedCrop`: `rrc_params`, scale (0.08, 1),
  ratio (3/4, 4/3)) to ``image_size`` squared, then horizontal flip with p = 0.5; eval = shorter
  side resized to ``floor(image_size * 256 / 224)`` then centre crop (`ResizeCenterCrop`), done
  as the decoders do it: the centre box of 224/256 of the shorter side, resized
  (`center_crop_box`, within a pixel of torchvision's Resize + CenterCrop). Backends
  that decode (cpu, dali, nvjpeg) fuse the crop (and the flip) into decoding; the memory backend
  stores each photo's centre square at ``floor(image_size * 256 / 224)`` and runs the ops on the
  device. Then normalize (the dataset's statistics, else ImageNet's).
- ``"none"``: normalize to float in [0, 1] (mean 0, std 255).

Targets (`fastdata.augment.targets`): `draw_regions` folds a preset's geometric ops into one
`Region` per sample (crop box in source pixels, flip, output size), which `warp_sample` (CPU, one
sample) and `warp_batch` (any device, batched) apply to the image (bilinear, antialiased), the
mask (nearest, `ignore_index` outside the image) and the boxes (affine, clipped, empty ones dropped).

Resizing is bilinear with antialiasing when shrinking (the filter of PIL and of torchvision /
``F.interpolate(..., antialias=True)``), computed as two batched matrix products with per-sample
weights, so each sample is cropped to its own box and resized exactly as "crop, then resize" would.
Resized pixels stay float (0..255 scale, not rounded back to uint8). Normalization is
``(x - mean) / std`` per channel with mean and std on the 0..255 scale; `Preset.apply` returns
float32 (by default) with the NCHW shape, on the input's device.
"""

from __future__ import annotations

from fastdata.augment.constants import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
)
from fastdata.augment.kernels import (
    crop_with_padding,
    flip_horizontal,
    normalize,
    random_crop_with_padding,
    random_flip,
    resize_center_crop,
    resized_crop,
)
from fastdata.augment.params import (
    batch_rrc_params,
    center_crop_box,
    pad_crop_params,
    rrc_params,
)
from fastdata.augment.presets import (
    DEFAULT_PHOTO_SIZE,
    PRESETS,
    SMALL_IMAGE_SIDE,
    BatchTransform,
    Flip,
    Op,
    PadCrop,
    Preset,
    RandomResizedCrop,
    ResizeCenterCrop,
    default_preset,
    get_preset,
    image_seed,
)
from fastdata.augment.targets import (
    Region,
    cover_region,
    draw_regions,
    warp_batch,
    warp_boxes,
    warp_sample,
)

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DEFAULT_PHOTO_SIZE",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PRESETS",
    "SMALL_IMAGE_SIDE",
    "BatchTransform",
    "Flip",
    "Op",
    "PadCrop",
    "Preset",
    "RandomResizedCrop",
    "Region",
    "ResizeCenterCrop",
    "batch_rrc_params",
    "center_crop_box",
    "cover_region",
    "default_preset",
    "crop_with_padding",
    "draw_regions",
    "flip_horizontal",
    "get_preset",
    "image_seed",
    "normalize",
    "pad_crop_params",
    "random_crop_with_padding",
    "random_flip",
    "resize_center_crop",
    "resized_crop",
    "rrc_params",
    "warp_batch",
    "warp_boxes",
    "warp_sample",
]
