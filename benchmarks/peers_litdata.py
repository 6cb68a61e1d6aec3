"""LitData, used the way its README shows: `litdata.optimize`, then `StreamingDataset` +
`StreamingDataLoader` with the per-sample transform passed as `transform=` (README, "Transform
datasets while Streaming").

Storage: CIFAR-100 pixels as raw uint8 arrays (lossless, the cheapest thing to deserialize; the
README's JPEG example would lose pixels and add a decode), photos as `litdata.Image(path=...)`
(the README's "replace with your files": the JPEG's own bytes, decoded by torchvision). Runs in
`.venv-peers` (see `setup_peers.sh`), started by `bench_peers.py` through `peers_run.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

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


def _cifar_item(index: int, archive: str, split: str) -> dict[str, Any]:
    pixels, labels = cifar_split(archive, split)
    return {"image": pixels[index], "label": int(labels[index])}


def _photo_item(item: tuple[str, int]) -> dict[str, Any]:
    import litdata as ld

    path, label = item
    return {"image": ld.Image(path=path), "label": label}


def convert(dataset: str, source: Path, out: Path, workers: int) -> int:
    """`litdata.optimize` every split of the input into `out/<split>`; returns samples written."""
    import litdata as ld

    total = 0
    if dataset == "cifar":
        for split in CIFAR_SPLITS:
            n = len(cifar_split(str(source), split)[1])  # the index range; workers load their own
            cifar_split.cache_clear()
            fn = partial(_cifar_item, archive=str(source), split=split)
            ld.optimize(
                fn=fn,
                inputs=list(range(n)),
                output_dir=str(out / split),
                num_workers=workers,
                chunk_bytes="64MB",
                verbose=False,
            )
            total += n
    else:
        for split in PHOTO_SPLITS:
            items = photo_items(str(source), split)
            ld.optimize(
                fn=_photo_item,
                inputs=items,
                output_dir=str(out / split),
                num_workers=workers,
                chunk_bytes="64MB",
                verbose=False,
            )
            total += len(items)
    return total


def loader(
    dataset: str, out: Path, cache: Path, mode: str, batch_size: int, workers: int
) -> tuple[Callable[[], Any], Callable[[Any], int]]:
    """(make_loader, consume) for `peers_common.time_epochs`.

    mode "readme": the whole torchvision pipeline per sample in the loader workers.
    mode "engine": the workers only turn samples into uint8 tensors (photos: cropped to 224 px);
    fastdata's batched augmentation + normalization runs on the collated batch after transfer.
    """
    import litdata as ld

    per_sample = readme_transform(dataset) if mode == "readme" else engine_geometry(dataset)

    def transform(sample: dict[str, Any], *args: Any, **kwargs: Any) -> tuple[torch.Tensor, int]:
        return per_sample(sample["image"]), sample["label"]

    def make_loader() -> Any:
        data = ld.StreamingDataset(
            str(out / "train"), cache_dir=str(cache), shuffle=True, transform=transform
        )
        return ld.StreamingDataLoader(data, batch_size=batch_size, num_workers=workers)

    if mode == "readme":
        return make_loader, lambda batch: batch[0].shape[0]
    augment = engine_consumer(dataset)
    return make_loader, lambda batch: augment(batch[0].as_subclass(torch.Tensor)).shape[0]
