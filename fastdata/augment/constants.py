"""Per-channel image statistics of the presets (RGB, 0..255 scale)."""

from __future__ import annotations

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

# Per-channel mean / std of the training split on the 0..255 scale (RGB). CIFAR-100 values were
# recomputed from the real training set (50,000 images, population std over all pixels).
IMAGENET_MEAN = (123.675, 116.28, 103.53)  # (0.485, 0.456, 0.406) * 255
IMAGENET_STD = (58.395, 57.12, 57.375)  # (0.229, 0.224, 0.225) * 255
CIFAR10_MEAN = (125.3069, 122.9504, 113.8654)
CIFAR10_STD = (62.9932, 62.0887, 66.7049)
CIFAR100_MEAN = (129.3042, 124.0700, 112.4341)
CIFAR100_STD = (68.1702, 65.3918, 70.4184)
