"""`ShardDataModule`: the drop-in LightningDataModule over a folder of fastdata shards.

    dm = ShardDataModule("shards/cifar100", batch_size=256, num_workers=2)
    trainer.fit(model, datamodule=dm)          # the model's code does not change

The loaders yield uint8 batches (or already-augmented ones: DALI, and the memory backend for the
`cifar` training split, which fuses its crop into the gather); `on_after_batch_transfer`
augments and normalizes them batched on the training device, after the cheap uint8 copy.
The module also keeps its position in the epoch (`state_dict`), so a run resumed from a mid-epoch
checkpoint continues with the next unseen batch instead of restarting the epoch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from fastdata._pool import TensorPool
from fastdata._threads import one_thread_on_cpu
from fastdata.augment import Preset, get_preset
from fastdata.manifest import Manifest, load_manifest
from fastdata.read import BatchLoader, LoaderSpec, get_backend

__all__ = ["ShardDataModule"]

log = logging.getLogger("fastdata")

VAL_SPLITS = ("val", "validation", "test")
DEFAULT_PHOTO_SIZE = 224
SMALL_IMAGE_SIDE = 64  # raw data at most this size gets the "cifar" preset under preset="auto"


class ShardDataModule(pl.LightningDataModule):
    """A LightningDataModule over a shard folder written by `fastdata shard`.

    Args:
        root: the shard folder (holding manifest.json), or a URL prefix for remote shards.
        batch_size: samples per batch on each rank.
        num_workers: loader processes (CPU backend) or "auto" to size them from measured core
            load and sample cost (fastdata.tune).
        prefetch_factor: batches prefetched per worker, or "auto".
        backend: "cpu", "dali", "memory", or "auto" (memory if its store of the training split,
            3.1x the uint8 split for the padded "cifar" layout, fits in a share of the device's
            free memory, else dali with a GPU, else cpu).
        preset: augmentation preset ("cifar", "photo", "none") or "auto" ("cifar" for small
            fixed-size images, else "photo").
        image_size: output side for variable-size photos (default 224); None for raw data.
        seed: base seed of shuffling and augmentation.
        on_error: "raise" at a corrupt sample, or "skip" it (counted, logged with its key).
        drop_last: drop each rank's last partial training batch.
        splits: override split names, e.g. {"train": "train", "val": "validation", "test": "test"}.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 256,
        num_workers: int | Literal["auto"] = "auto",
        prefetch_factor: int | Literal["auto"] = "auto",
        backend: str = "auto",
        preset: str = "auto",
        image_size: int | None = None,
        seed: int = 0,
        on_error: Literal["raise", "skip"] = "raise",
        drop_last: bool = True,
        splits: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor)):
            if value != "auto" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or 'auto', got {value!r}")
        self.root = os.fspath(root)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.backend = backend
        self.preset = preset
        self.image_size = image_size
        self.seed = seed
        self.on_error = on_error
        self.drop_last = drop_last
        self.split_names = dict(splits or {})
        self.manifest: Manifest | None = None
        self._preset: Preset | None = None
        self._backend_name: str | None = None
        self._augmented = False
        self._train_mode = False
        self._epoch = 0
        self._batches_seen = 0
        self._resume: tuple[int, int] | None = None
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pool = TensorPool()  # CPU batches: reuse released memory instead of page-faulting
        self._loaders: list[_EpochLoader] = []

    # ------------------------------------------------------------------ setup

    def setup(self, stage: str | None = None) -> None:
        """Load the manifest and resolve splits, preset and backend (idempotent)."""
        if self.manifest is not None:
            return
        self.manifest = load_manifest(self.root)
        self.split_names = _resolve_splits(self.manifest, self.split_names)
        train = self.manifest.split(
            self.split_names.get("train") or next(iter(self.manifest.splits))
        )
        small = train.raw_shape is not None and max(train.raw_shape[:2]) <= SMALL_IMAGE_SIDE
        if self.image_size is None and train.raw_shape is None:
            # Images of different sizes must be cropped to one; fixed-size data keeps its size.
            self.image_size = DEFAULT_PHOTO_SIZE
        preset = self.preset if self.preset != "auto" else ("cifar" if small else "photo")
        self._backend_name = self._choose_backend(preset)
        if preset == "photo" and self._backend_name == "memory":
            # The memory backend stores photos whole (resized to 256/224 of the output size), so
            # the random-resized crop runs on the device instead of at decode time.
            preset = "photo_device"
        self._preset = get_preset(preset, self.image_size)

    def _choose_backend(self, preset: str) -> str:
        if self.backend != "auto":
            get_backend(self.backend)  # fail early on a bad name or a missing optional package
            return self.backend
        from fastdata.read.auto import choose_backend

        trainer = self._trainer_or_none()
        name, _reason = choose_backend(  # logs its choice and the figures behind it
            self.manifest,
            self.split_names.get("train", "train"),
            str(self._device()),
            self.image_size,
            preset=preset,
            ranks_per_node=trainer.num_devices if trainer is not None else 1,
        )
        if trainer is not None and trainer.world_size > 1:
            # Free memory differs between ranks; all ranks must use rank 0's choice.
            name = trainer.strategy.broadcast(name, src=0)
        return name

    # ------------------------------------------------------------------ loaders

    def train_dataloader(self) -> BatchLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> BatchLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> BatchLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> BatchLoader:
        return self._loader("test", train=False)

    def loader_spec(self, role: str, train: bool) -> LoaderSpec:
        """The LoaderSpec of a split role ("train", "val", "test") on this rank."""
        self.setup()
        split = self.split_names.get(role)
        if split is None:
            raise ValueError(
                f"{self.root} has no {role} split (splits: {sorted(self.manifest.splits)})"
            )
        rank, world = self._rank_world()
        spec = LoaderSpec(
            manifest=self.manifest,
            split=split,
            train=train,
            batch_size=self.batch_size,
            seed=self.seed,
            epoch=self._epoch,
            rank=rank,
            world_size=world,
            image_size=self.image_size,
            preset=self._preset.name,
            on_error=self.on_error,
            device=str(self._device()),
            drop_last=self.drop_last and train,
        )
        return self._size_workers(spec)

    def _loader(self, role: str, train: bool) -> BatchLoader:
        spec = self.loader_spec(role, train)
        loader = _EpochLoader(self, spec, get_backend(self._backend_name))
        self._loaders.append(loader)
        return loader

    def resize_workers(self, num_workers: int, prefetch_factor: int | None = None) -> None:
        """Change the loader processes from the next epoch on (used by `LoaderMonitor`).

        Every loader built so far rebuilds its backend with the new figures the next time it is
        iterated (shutting down its persistent workers); loaders built later use them directly.
        """
        if num_workers < 0 or (prefetch_factor is not None and prefetch_factor < 1):
            raise ValueError(
                f"need num_workers >= 0 and prefetch_factor >= 1, got {num_workers}, {prefetch_factor}"
            )
        self.num_workers = num_workers
        if prefetch_factor is not None:
            self.prefetch_factor = prefetch_factor
        for loader in self._loaders:
            loader.resize(num_workers, prefetch_factor)

    def _size_workers(self, spec: LoaderSpec) -> LoaderSpec:
        workers, prefetch = self.num_workers, self.prefetch_factor
        if "auto" in (workers, prefetch):
            from fastdata.tune import auto_loader_settings

            trainer = self._trainer_or_none()
            # Ranks on one node share its cores; Lightning's launcher does not export that count.
            ranks_per_node = trainer.num_devices if trainer is not None else None
            settings = auto_loader_settings(
                spec, backend=self._backend_name, ranks_per_node=ranks_per_node
            )
            workers = settings.num_workers if workers == "auto" else workers
            prefetch = settings.prefetch_factor if prefetch == "auto" else prefetch
            spec = _replace(
                spec, pin_memory=settings.pin_memory, persistent_workers=settings.persistent_workers
            )
        return _replace(spec, num_workers=int(workers), prefetch_factor=int(prefetch))

    # ------------------------------------------------------------------ device augmentation

    def on_after_batch_transfer(
        self, batch: Any, dataloader_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Augment (training) and normalize a uint8 batch on its device; count consumed batches."""
        x, y = batch
        train = self._is_training()
        if train:
            self._batches_seen += 1
        # `_augmented` is the last iterated loader's flag; a validation run in the middle of a
        # training epoch resets it, so the dtype also tells: augmented batches are float.
        if self._augmented or x.is_floating_point():
            return x, y
        self.setup()
        with one_thread_on_cpu(x.device):
            generator = self._generator(x.device)
            return self._preset.apply(x, train, generator, self._pool), y

    def _is_training(self) -> bool:
        trainer = self._trainer_or_none()
        if trainer is not None:
            return bool(trainer.training)
        return self._train_mode

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            rank, _ = self._rank_world()
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed * 1_000_003 + rank)
            self._generators[device] = gen
        return self._generators[device]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Position in the training epoch: {"epoch", "batches_seen"} (saved in checkpoints)."""
        return {"epoch": self._epoch, "batches_seen": self._batches_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next training epoch iterated, if it is `epoch`, skips `batches_seen`."""
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches_seen"]))
        self._epoch, self._batches_seen = self._resume

    # ------------------------------------------------------------------ helpers

    def _trainer_or_none(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def _rank_world(self) -> tuple[int, int]:
        trainer = self._trainer_or_none()
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return 0, 1

    def _device(self) -> torch.device:
        trainer = self._trainer_or_none()
        if trainer is not None:
            return trainer.strategy.root_device
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

    def _start_epoch(self, train: bool, augmented: bool) -> tuple[int, int]:
        """Called when a loader is iterated: the (epoch, first batch) it must produce."""
        self._train_mode = train
        self._augmented = augmented
        if not train:
            return 0, 0
        trainer = self._trainer_or_none()
        epoch = trainer.current_epoch if trainer is not None else self._next_epoch()
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        self._resume = None
        self._epoch, self._batches_seen = epoch, start
        return epoch, start

    def _next_epoch(self) -> int:
        epoch = getattr(self, "_manual_epoch", -1) + 1
        self._manual_epoch = epoch
        return epoch


class _EpochLoader:
    """The loader Lightning sees: hands the epoch and resume position to the backend.

    A backend loader with `set_epoch(epoch, start_batch)` is reused across epochs (the CPU
    backend keeps its persistent workers); any other is rebuilt from the spec for each epoch.
    """

    def __init__(self, datamodule: ShardDataModule, spec: LoaderSpec, factory: Any) -> None:
        self.datamodule = datamodule
        self.spec = spec
        self.factory = factory
        self.loader: BatchLoader = factory(spec)
        self.augmented = self.loader.augmented
        self._built_for = (spec.epoch, spec.start_batch)
        self._stale = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator: nothing runs until the first next(). Lightning calls iter() once more than
        # it iterates (data_connector._check_dataloader_iterable drops that iterator), and on
        # resume its first next() comes after the loops are restored, when
        # trainer.current_epoch is the epoch that really runs.
        return self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, start = self.datamodule._start_epoch(self.spec.train, self.augmented)
        if hasattr(self.loader, "set_epoch") and not self._stale:
            self.loader.set_epoch(epoch, start)
        elif (epoch, start) != self._built_for or self._stale:
            self._rebuild(epoch, start)
        yield from self.loader

    def resize(self, num_workers: int, prefetch_factor: int | None) -> None:
        """Use new worker figures from the next iteration on."""
        changes = {"num_workers": num_workers}
        if prefetch_factor is not None:
            changes["prefetch_factor"] = prefetch_factor
        self.spec = _replace(self.spec, **changes)
        self._stale = True

    def _rebuild(self, epoch: int, start: int) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()
        self.loader = self.factory(_replace(self.spec, epoch=epoch, start_batch=start))
        self._built_for = (epoch, start)
        self._stale = False

    def __getattr__(self, name: str) -> Any:  # the backend's extras (skipped, ...)
        # Not `dataset`: Lightning would then warn that an IterableDataset's length may be
        # inexact with workers, which this plan's is not.
        if name in ("loader", "dataset"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _resolve_splits(manifest: Manifest, given: dict[str, str]) -> dict[str, str]:
    names = dict(given)
    available = manifest.splits
    if "train" not in names and "train" in available:
        names["train"] = "train"
    if "val" not in names:
        names["val"] = next((s for s in VAL_SPLITS if s in available), names.get("train", ""))
    if "test" not in names:
        names["test"] = "test" if "test" in available else names["val"]
    for role, split in names.items():
        if split and split not in available:
            raise ValueError(
                f"{role} split {split!r} is not in {manifest.root} (splits: {sorted(available)})"
            )
    return {role: split for role, split in names.items() if split}


def _replace(spec: LoaderSpec, **changes: Any) -> LoaderSpec:
    from dataclasses import replace

    return replace(spec, **changes)
