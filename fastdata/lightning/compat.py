"""What lets one `ShardDataModule` serve every Lightning user's code.

Lightning ships under two package names with the same classes: `lightning.pytorch` and the older
`pytorch_lightning` (most public Lightning code, Lightning's own tutorials included, imports the
latter). Each package's Trainer accepts only its own `LightningDataModule` (`isinstance`, then
`is_overridden` against that class: "Expected a parent" otherwise). `DATAMODULE_BASES` is
therefore both packages' `LightningDataModule` where both import, so that the class built on it
is a DataModule to either Trainer; `lightning.pytorch`'s comes first and its hooks are the ones
that run.

`FabricLoader` is the `torch.utils.data.DataLoader` that Lightning Fabric's `setup_dataloaders`
requires (it accepts nothing else): it passes an `EpochLoader`'s batches through unchanged.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

import lightning.pytorch
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["DATAMODULE_BASES", "FabricLoader", "datamodule_bases"]

log = logging.getLogger("fastdata")


def datamodule_bases() -> tuple[type, ...]:
    """`lightning.pytorch.LightningDataModule`, then `pytorch_lightning`'s where that imports.

    Returns:
        The base classes, `lightning.pytorch`'s first (its hooks win the method resolution
        order; both packages' hook bodies are the same code, so either Trainer's
        `is_overridden` sees the shared hooks a subclass leaves alone as not overridden).
    """
    bases: list[type] = [lightning.pytorch.LightningDataModule]
    try:
        legacy = importlib.import_module("pytorch_lightning")
    except ImportError:
        log.debug("pytorch_lightning is not installed: ShardDataModule is a lightning.pytorch one")
        return tuple(bases)
    other = legacy.LightningDataModule
    if other is not bases[0]:  # one package may alias the other's classes
        bases.append(other)
    return tuple(bases)


#: The bases of `fastdata.ShardDataModule`, computed once at import.
DATAMODULE_BASES: tuple[type, ...] = datamodule_bases()


class _Batches(Protocol):
    """What `FabricLoader` wraps: an `EpochLoader` (iterable, sized, one epoch per `iter`)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class _EpochIterable(IterableDataset):
    """The loader's batches as an IterableDataset; `len` is the loader's batch count."""

    def __init__(self, loader: _Batches) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def _keep(batch: Any) -> Any:
    return batch


class FabricLoader(DataLoader):
    """A real `DataLoader` over an `EpochLoader`, for `fabric.setup_dataloaders`.

    It runs in the calling process (`num_workers=0`; the wrapped loader has its own workers) and
    hands on each batch as the wrapped loader made it (`batch_size=None`, identity collate): each
    `iter()` is one epoch of the wrapped loader, so epochs advance as with the loader itself.
    `len()` and `len(.dataset)` are the epoch's batches on this rank. Fabric adds no sampler to it
    (its dataset is iterable); the DataModule's rank and world size split the data.

    Args:
        loader: the `EpochLoader` (e.g. `dm.train_dataloader()`).
    """

    def __init__(self, loader: _Batches) -> None:
        super().__init__(_EpochIterable(loader), batch_size=None, collate_fn=_keep, num_workers=0)
        self.loader = loader
