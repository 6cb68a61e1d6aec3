"""The per-sample loaders `bench_loader.py` measures fastdata against (torchvision-style recipes).

- `ArrayDataset`: map-style, in-memory CIFAR uint8 arrays, per-sample pad-crop + flip + to-tensor +
  normalize (`cifar_augment`);
- `webdataset_loader`: PNG shards, per-sample PIL decode and the same augmentation (the WebDataset
  docs' recipe);
- `PhotoFolder`: ImageFolder-style JPEGs, full Pillow decode, random-resized crop (Pillow's boxed
  resize), flip, to-tensor, normalize.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastdata.augment import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD, rrc_params

__all__ = ["ArrayDataset", "PhotoFolder", "cifar_augment", "webdataset_loader"]


def _to_tensor(pixels: np.ndarray, mean, std) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float()
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def cifar_augment(pixels: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """torchvision-style per sample: RandomCrop(32, padding=4), flip, ToTensor, Normalize."""
    padded = np.pad(pixels, ((4, 4), (4, 4), (0, 0)))
    top, left = rng.integers(0, 9, size=2)
    crop = padded[top : top + 32, left : left + 32]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return _to_tensor(crop, CIFAR100_MEAN, CIFAR100_STD)


def _process_rng() -> np.random.Generator:
    """A generator per process, so that DataLoader workers do not draw identical augmentations."""
    return np.random.default_rng([0, os.getpid()])


class ArrayDataset(Dataset):
    """Map-style: in-memory uint8 arrays, per-sample augmentation."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray) -> None:
        self.pixels, self.labels = pixels, labels
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        self.rng = self.rng or _process_rng()
        return cifar_augment(self.pixels[i], self.rng), int(self.labels[i])


def webdataset_loader(urls: list[str], batch_size: int, workers: int, prefetch: int):
    import webdataset as wds

    state: dict[str, np.random.Generator] = {}

    def augment(image: Image.Image) -> torch.Tensor:
        return cifar_augment(np.asarray(image), state.setdefault("rng", _process_rng()))

    dataset = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=None, workersplitter=wds.split_by_worker
        )
        .shuffle(1000)
        .decode("pil")
        .to_tuple("png", "cls")
        .map_tuple(augment, int)
        .batched(batch_size)
    )
    return wds.WebLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch if workers else None,
    )


class PhotoFolder(Dataset):
    """ImageFolder-style: full Pillow decode, random-resized-crop, flip, to-tensor, per sample."""

    def __init__(self, root: Path, size: int) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (f, i) for i, c in enumerate(classes) for f in sorted((root / c).glob("*.jpg"))
        ]
        self.size = size
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        self.rng = self.rng or _process_rng()
        image = Image.open(path).convert("RGB")
        top, left, h, w = rrc_params(
            image.height, image.width, (0.08, 1.0), (3 / 4, 4 / 3), self.rng
        )
        image = image.resize(
            (self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h)
        )
        if self.rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor(np.asarray(image), IMAGENET_MEAN, IMAGENET_STD), label
