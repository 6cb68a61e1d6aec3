"""MosaicML Streaming, used the way its README and docs show: `MDSWriter` with zstd compression,
then `StreamingDataset(local=..., remote=..., shuffle=True, batch_size=...)` and a plain torch
`DataLoader`, the per-sample transform in a `StreamingDataset` subclass's `__getitem__` (as
Streaming's own vision datasets do).

Conversion with N processes follows the docs' "Parallel dataset conversion" (option 2): each
process writes its part of a split with its own `MDSWriter` into a sub-folder, then
`merge_index` joins the parts' indexes. Storage: CIFAR-100 pixels as `ndarray:uint8:32,32,3`
(lossless, cheapest to decode), photos as `jpeg` (the file's own bytes). The loader reads from a
`local` cache folder that it fills from `remote` (the written folder) in the first epoch.
Runs in `.venv-peers` (see `setup_peers.sh`), started by `bench_peers.py` through `peers_run.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peers_common import (
    CIFAR_SPLITS,
    PHOTO_SPLITS,
    cifar_split,
    engine_consumer,
    engine_geometry,
    photo_items,
    readme_transform,
)

__all__ = ["convert", "loader"]

CIFAR_COLUMNS = {"image": "ndarray:uint8:32,32,3", "label": "int"}
PHOTO_COLUMNS = {"image": "jpeg", "label": "int"}


def _write_cifar_part(part: tuple[int, int, int], archive: str, split: str, out: str) -> int:
    from streaming import MDSWriter

    index, start, stop = part
    pixels, labels = cifar_split(archive, split)
    with MDSWriter(out=f"{out}/{index}", columns=CIFAR_COLUMNS, compression="zstd") as writer:
        for i in range(start, stop):
            writer.write({"image": pixels[i], "label": int(labels[i])})
    return stop - start


def _write_photo_part(part: tuple[int, list[tuple[str, int]]], out: str) -> int:
    from PIL import Image
    from streaming import MDSWriter

    index, items = part
    with MDSWriter(out=f"{out}/{index}", columns=PHOTO_COLUMNS, compression="zstd") as writer:
        for path, label in items:
            with Image.open(path) as image:  # the jpeg encoding copies the file's own bytes
                writer.write({"image": image, "label": label})
    return len(items)


def _parts(n: int, workers: int) -> list[tuple[int, int, int]]:
    bounds = np.linspace(0, n, workers + 1).astype(int)
    return [(i, int(bounds[i]), int(bounds[i + 1])) for i in range(workers)]


def convert(dataset: str, source: Path, out: Path, workers: int) -> int:
    """Write every split into `out/<split>` with `workers` MDSWriter processes; samples written."""
    from streaming.base.util import merge_index

    total = 0
    with get_context("fork").Pool(workers) as pool:
        for split in CIFAR_SPLITS if dataset == "cifar" else PHOTO_SPLITS:
            target = str(out / split)
            if dataset == "cifar":
                n = len(cifar_split(str(source), split)[1])
                cifar_split.cache_clear()  # each writer process loads its own copy
                job = partial(_write_cifar_part, archive=str(source), split=split, out=target)
                total += sum(pool.map(job, _parts(n, workers)))
            else:
                items = photo_items(str(source), split)
                chunks = [(i, items[i::workers]) for i in range(workers)]
                total += sum(pool.map(partial(_write_photo_part, out=target), chunks))
            merge_index(target, keep_local=True)
    return total


def loader(
    dataset: str, out: Path, cache: Path, mode: str, batch_size: int, workers: int
) -> tuple[Callable[[], Any], Callable[[Any], int]]:
    """(make_loader, consume) for `peers_common.time_epochs`.

    mode "readme": the whole torchvision pipeline per sample in the DataLoader workers.
    mode "engine": the workers only turn samples into uint8 tensors (photos: cropped to 224 px);
    fastdata's batched augmentation + normalization runs on the collated batch after transfer.
    """
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    per_sample = readme_transform(dataset) if mode == "readme" else engine_geometry(dataset)

    class TransformedDataset(StreamingDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            sample = super().__getitem__(index)
            return per_sample(sample["image"]), sample["label"]

    def make_loader() -> Any:
        clean_stale_shared_memory()
        data = TransformedDataset(
            remote=str(out / "train"), local=str(cache), shuffle=True, batch_size=batch_size
        )
        return torch.utils.data.DataLoader(data, batch_size=batch_size, num_workers=workers)

    if mode == "readme":
        return make_loader, lambda batch: batch[0].shape[0]
    augment = engine_consumer(dataset)
    return make_loader, lambda batch: augment(batch[0].as_subclass(torch.Tensor)).shape[0]
