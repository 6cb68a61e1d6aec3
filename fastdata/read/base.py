"""The contract every read backend meets (see docs/DESIGN.md, "Reader contract")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from fastdata.manifest import Manifest

__all__ = ["BatchLoader", "LoaderSpec", "check_start_batch"]


@runtime_checkable
class BatchLoader(Protocol):
    """Batches of one split on one rank for one epoch.

    Attributes:
        augmented: True when the backend already augmented and normalized the images (float);
            False when it yields uint8 images for `ShardDataModule.on_after_batch_transfer`.
    """

    augmented: bool

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class LoaderSpec:
    """What a backend needs to build the loader of one split on one rank.

    Args:
        manifest: the shard folder's manifest.
        split: split name ("train", "val", "test").
        train: True for the training split (shuffle, augment, pad to equal batches).
        batch_size: samples per batch on this rank.
        seed: base seed; every random choice derives from (seed, epoch, rank, ...).
        epoch: epoch number (the shuffle changes every epoch).
        rank: global rank of this process.
        world_size: number of processes.
        num_workers: DataLoader worker processes (CPU backend), or DALI CPU threads.
        prefetch_factor: batches prefetched per worker (ignored when num_workers == 0).
        image_size: output (H, W) for variable-size images; None keeps the stored size (raw data).
        preset: augmentation preset name ("cifar", "photo", "none").
        on_error: "raise" (default) or "skip" for corrupt samples at read time.
        device: the training device ("cpu", "cuda:0"); backends that place data there use it.
        start_batch: batches of this epoch already consumed (mid-epoch resume).
        drop_last: drop the last partial batch of each rank (train default True).
        pin_memory: pin batches for faster host-to-GPU copies; None: when CUDA is available.
        persistent_workers: keep workers between epochs; None: when there are workers.
    """

    manifest: Manifest
    split: str
    train: bool
    batch_size: int
    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    prefetch_factor: int = 2
    image_size: int | tuple[int, int] | None = None
    preset: str = "none"
    on_error: str = "raise"
    device: str = "cpu"
    start_batch: int = 0
    drop_last: bool = False
    pin_memory: bool | None = None
    persistent_workers: bool | None = None


def check_start_batch(start_batch: int, total_batches: int) -> int:
    """`start_batch` if it is a valid resume position in an epoch of `total_batches`, else ValueError."""
    if not 0 <= start_batch <= total_batches:
        raise ValueError(
            f"start_batch must be in [0, {total_batches}] (batches per epoch on this rank), "
            f"got {start_batch}"
        )
    return start_batch
