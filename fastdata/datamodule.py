"""`ShardDataModule`: the drop-in LightningDataModule over a folder of fastdata shards.

    dm = ShardDataModule("shards/cifar100", batch_size=256, num_workers=2)
    trainer.fit(model, datamodule=dm)          # the model's code does not change

Every backend reads the same epoch plan (`fastdata.read.plan`) and yields uint8 batches (or,
where it fuses the whole preset, normalized ones); `on_after_batch_transfer` runs the rest of the
transforms batched on the training device, after the cheap uint8 copy, seeded per batch from the
plan. The module keeps its position in the epoch as global samples consumed (`state_dict`), so a
run resumed from a mid-epoch checkpoint, even with another world size or batch size, continues
with exactly the samples not yet trained on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from fastdata._pool import TensorPool
from fastdata._threads import one_thread_on_cpu
from fastdata.augment import Preset
from fastdata.augment.resolve import TransformSpec, resolve_transforms
from fastdata.manifest import Manifest, load_manifest
from fastdata.read import BatchLoader, LoaderSpec, WorkerSettings, get_backend
from fastdata.read.plan import EpochPlan, batch_seed
from fastdata.resume import ResumeState, dataset_fingerprint

__all__ = ["ShardDataModule"]

log = logging.getLogger("fastdata")

VAL_SPLITS = ("val", "validation")
DEFAULT_PHOTO_SIZE = 224
SMALL_IMAGE_SIDE = 64  # raw data at most this size gets the "cifar" preset by default


class ShardDataModule(pl.LightningDataModule):
    """A LightningDataModule over a shard folder written by `fastdata shard`.

    Keyword arguments rather than a config object (against the ~8-parameter rule of thumb): this
    is the one public constructor users type, and Lightning's CLI and `save_hyperparameters` read
    keyword arguments.

    Args:
        root: the shard folder (holding manifest.json), or a URL prefix for remote shards.
        batch_size: samples per batch on each rank.
        num_workers: loader processes (cpu backend) or "auto" to size them from measured core
            load and sample cost (fastdata.tune).
        prefetch_factor: batches prefetched per worker, or "auto".
        backend: a name in `fastdata.read.BACKENDS` ("cpu", "dali", "memory") or "auto" (memory
            if its store of the training split fits a share of the device's free memory, else a
            GPU decoder with a GPU, else cpu).
        train_transforms: a preset name ("cifar", "photo", "none"), a `fastdata.augment.Preset`,
            or a callable on uint8 (N, 3, H, W) batches on the device (e.g. torchvision
            transforms v2, kornia); None: "cifar" for small fixed-size images, else "photo".
        eval_transforms: the same for val/test batches; None: the train preset's eval ops (for a
            callable: none, i.e. normalization only).
        mean: per-channel mean on the 0..255 scale; None: a `Preset` object's own, else the
            training split's, measured by `fastdata shard` (else the preset's).
        std: per-channel std on the 0..255 scale; None: as for `mean`.
        image_size: output side of photos (default 224); None keeps fixed-size data's size.
        seed: base seed of shuffling and augmentation.
        on_error: "raise" at a corrupt sample, or "skip" it (counted, logged with its key).
        drop_last: drop each epoch's last short training step (all ranks alike).
        splits: override split names, e.g. {"train": "train", "val": "validation", "test": "test"}.
        rank: this process's global rank; None: the Trainer's, else torch.distributed's, else 0.
        world_size: ranks; None: the Trainer's, else torch.distributed's, else 1.
        decode_threads: threads decoding a batch's photos in each worker (cpu backend).
        cache_dir: local cache of a remote dataset's shards (None: $FASTDATA_CACHE_DIR or
            ~/.cache/fastdata/shards).
        cache_limit: most bytes that cache may hold, e.g. "50GB" (None: its default).
        preset: an older name of `train_transforms` (and of the eval ops that go with it).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 256,
        num_workers: int | Literal["auto"] = "auto",
        prefetch_factor: int | Literal["auto"] = "auto",
        backend: str = "auto",
        train_transforms: TransformSpec | None = None,
        eval_transforms: TransformSpec | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        image_size: int | None = None,
        seed: int = 0,
        on_error: Literal["raise", "skip"] = "raise",
        drop_last: bool = True,
        splits: dict[str, str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        decode_threads: int = 1,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        preset: str | Preset | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor)):
            if value != "auto" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or 'auto', got {value!r}")
        if (rank is None) != (world_size is None):
            raise ValueError(f"pass rank and world_size together, got {rank} and {world_size}")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank} and {world_size}")
        if backend != "auto":
            get_backend(backend)  # a bad name fails here, with the choices
        self.root = os.fspath(root)
        self.batch_size, self.seed, self.on_error = batch_size, seed, on_error
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.backend, self.image_size, self.drop_last = backend, image_size, drop_last
        self.train_transforms_spec = train_transforms if train_transforms is not None else preset
        self.eval_transforms_spec = eval_transforms
        self.mean, self.std = mean, std
        self.split_names = dict(splits or {})
        self.rank, self.world_size = rank, world_size
        self.decode_threads = decode_threads
        self.cache_dir, self.cache_limit = cache_dir, cache_limit
        self.manifest: Manifest | None = None
        self.transforms: Preset | None = None  # resolved in setup
        self.backend_name: str | None = None
        self._train_mode = False
        self._flags: dict[bool, tuple[bool, int]] = {}  # train? -> (normalized, applied_ops)
        self._epoch, self._batches = 0, 0
        self._plan: EpochPlan | None = None
        self._resume: ResumeState | None = None
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pool = TensorPool()  # CPU batches: reuse released memory instead of page-faulting
        self._loaders: list[_EpochLoader] = []
        self._cache: Any = None

    # ------------------------------------------------------------------ setup

    def setup(self, stage: str | None = None) -> None:
        """Load the manifest and resolve splits, transforms and backend (idempotent)."""
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
        chosen = self.train_transforms_spec or ("cifar" if small else "photo")
        # A Preset object carries the statistics its author chose; names and callables get the
        # dataset's own (measured by `fastdata shard`), where the manifest has them.
        own = isinstance(chosen, Preset)
        mean = self.mean if self.mean is not None or own else train.pixel_mean
        std = self.std if self.std is not None or own else train.pixel_std
        self.transforms = resolve_transforms(
            chosen, self.eval_transforms_spec, self.image_size, mean, std
        )
        self.backend_name = self._choose_backend()
        if self._resume is not None:
            self._check_resume(self._resume)

    def _choose_backend(self) -> str:
        if self.backend != "auto":
            ok, why = get_backend(self.backend).check()
            if not ok:
                raise ValueError(f"backend {self.backend!r} cannot run here: {why}")
            return self.backend
        from fastdata.read.auto import choose_backend

        trainer = self._trainer_or_none()
        name, _reason = choose_backend(  # logs its choice and the figures behind it
            self.manifest,
            self.split_names.get("train", "train"),
            str(self._device()),
            self.image_size,
            preset=self.transforms,
            ranks_per_node=trainer.num_devices if trainer is not None else 1,
        )
        if trainer is not None and trainer.world_size > 1:
            # Free memory differs between ranks; all ranks must use rank 0's choice.
            name = trainer.strategy.broadcast(name, src=0)
        return name

    # ------------------------------------------------------------------ loaders

    def train_dataloader(self) -> BatchLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> BatchLoader | list:
        self.setup()
        if "val" not in self.split_names:
            log.warning(
                "%s has no validation split (splits: %s): validation is skipped. Pass "
                "splits={'val': 'test'} to validate on the test split, or write one with "
                "`fastdata shard` from a source that has it.",
                self.root,
                sorted(self.manifest.splits),
            )
            return []  # Lightning runs no validation batch; never the training split
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
                f"{self.root} has no {role} split (splits: {sorted(self.manifest.splits)}); "
                f"pass splits={{'{role}': NAME}} naming one of them"
            )
        rank, world = self._rank_world()
        spec = LoaderSpec(
            manifest=self.manifest,
            split=split,
            train=train,
            batch_size=self.batch_size,
            preset=self.transforms,
            seed=self.seed,
            epoch=self._epoch,
            rank=rank,
            world_size=world,
            image_size=self.image_size,
            on_error=self.on_error,
            device=str(self._device()),
            drop_last=self.drop_last and train,
            cache=self._shard_cache(),
        )
        return self._size_workers(spec)

    def _loader(self, role: str, train: bool) -> BatchLoader:
        spec = self.loader_spec(role, train)
        loader = _EpochLoader(self, spec, get_backend(self.backend_name).load())
        self._loaders.append(loader)
        return loader

    def _shard_cache(self) -> Any:
        if "://" not in self.root or (self.cache_dir is None and self.cache_limit is None):
            return None  # local shards, or the reader's default cache for a remote root
        if self._cache is None:
            from fastdata.remote import DEFAULT_LIMIT, ShardCache, default_cache_dir

            self._cache = ShardCache(
                self.cache_dir or default_cache_dir(), self.cache_limit or DEFAULT_LIMIT
            )
        return self._cache

    def resize_workers(self, num_workers: int, prefetch_factor: int | None = None) -> None:
        """Change the loader processes from the next epoch on (used by `LoaderMonitor`)."""
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
        settings = WorkerSettings(decode_threads=self.decode_threads)
        if "auto" in (workers, prefetch):
            from fastdata.tune import auto_loader_settings

            trainer = self._trainer_or_none()
            # Ranks on one node share its cores; Lightning's launcher does not export that count.
            ranks_per_node = trainer.num_devices if trainer is not None else None
            auto = auto_loader_settings(
                spec, backend=self.backend_name, ranks_per_node=ranks_per_node
            )
            workers = auto.num_workers if workers == "auto" else workers
            prefetch = auto.prefetch_factor if prefetch == "auto" else prefetch
            settings = replace(
                settings, pin_memory=auto.pin_memory, persistent_workers=auto.persistent_workers
            )
        settings = replace(
            settings, num_workers=int(workers), prefetch_factor=max(1, int(prefetch))
        )
        return replace(spec, workers=settings)

    # ------------------------------------------------------------------ device augmentation

    def on_after_batch_transfer(
        self, batch: Any, dataloader_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the transforms the loader left (training: seeded from the plan) on the device."""
        x, y = batch
        train = self._is_training()
        seed = self._batch_seed() if train else self.seed
        if train:
            self._batches += 1
        normalized, applied = self._flags.get(train, (x.is_floating_point(), 0))
        if normalized or x.is_floating_point():
            return x, y
        self.setup()
        with one_thread_on_cpu(x.device):
            generator = self._generator(x.device).manual_seed(seed)
            return self.transforms.apply(x, train, generator, self._pool, skip=applied), y

    def _batch_seed(self) -> int:
        plan = self._plan
        if plan is not None and 0 <= self._batches - plan.steps_before < len(plan.seeds):
            return plan.seeds[self._batches - plan.steps_before]
        # A batch no plan covers (a loader iterated outside `_EpochLoader`): the plan's own seed
        # derivation, at a position no planned batch starts at.
        return batch_seed(self.seed, self._epoch, -1 - self._batches)

    def _is_training(self) -> bool:
        trainer = self._trainer_or_none()
        if trainer is not None:
            return bool(trainer.training)
        return self._train_mode

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The position in the training epoch (`fastdata.resume.ResumeState`; in checkpoints)."""
        self.setup()
        split = self.split_names.get("train", "train")
        rank, world = self._rank_world()
        plan = self._plan
        if plan is not None:
            consumed = plan.consumed_after(self._batches - plan.steps_before)
        else:
            consumed = self._resume.consumed if self._resume is not None else 0
        state = ResumeState(
            epoch=self._epoch,
            consumed=consumed,
            steps=self._batches,
            seed=self.seed,
            world_size=world,
            batch_size=self.batch_size,
            num_samples=self.manifest.split(split).num_samples,
            dataset=dataset_fingerprint(self.manifest, split),
        )
        return state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the training epoch `epoch`, when it runs, starts after the consumed samples.

        Raises:
            fastdata.resume.ResumeError: the state belongs to another dataset or seed, or was
                saved by an older fastdata.
        """
        state = ResumeState.from_dict(state_dict)
        self._check_resume(state)
        self._resume = state
        self._epoch, self._batches = state.epoch, state.steps

    def _check_resume(self, state: ResumeState) -> None:
        manifest = self.manifest or load_manifest(self.root)
        split = self.split_names.get("train", "train")
        if split not in manifest.splits:
            return  # checked again in setup, once the split names are resolved
        state.check(
            self.seed, manifest.split(split).num_samples, dataset_fingerprint(manifest, split)
        )

    # ------------------------------------------------------------------ helpers

    def _trainer_or_none(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def _rank_world(self) -> tuple[int, int]:
        if self.world_size is not None:
            return self.rank, self.world_size
        trainer = self._trainer_or_none()
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
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

    def _start_epoch(self, loader: _EpochLoader) -> tuple[int, int, int]:
        """Called when a loader is iterated: the (epoch, consumed, steps before) it must produce."""
        train = loader.spec.train
        self._train_mode = train
        self._flags[train] = (loader.loader.normalized, loader.loader.applied_ops)
        if not train:
            return 0, 0, 0
        trainer = self._trainer_or_none()
        epoch = trainer.current_epoch if trainer is not None else self._next_epoch()
        consumed = steps = 0
        if self._resume is not None and self._resume.epoch == epoch:
            consumed, steps = self._resume.consumed, self._resume.steps
        self._resume = None
        self._epoch, self._batches = epoch, steps
        self._plan = loader.spec.plan(epoch, consumed, steps)
        return epoch, consumed, steps

    def _pending_len(self, spec: LoaderSpec) -> int | None:
        """Batches of the resumed epoch when a resume is pending (len() before iteration)."""
        if not spec.train or self._resume is None:
            return None
        state = self._resume
        return len(spec.plan(state.epoch, state.consumed, state.steps))

    def _next_epoch(self) -> int:
        epoch = getattr(self, "_manual_epoch", -1) + 1
        self._manual_epoch = epoch
        return epoch


class _EpochLoader:
    """The loader Lightning sees: hands the epoch and resume position to the backend.

    The backend loader is reused across epochs (`set_epoch`); it is rebuilt only after
    `resize_workers` changed its worker settings.
    """

    def __init__(
        self, datamodule: ShardDataModule, spec: LoaderSpec, factory: Callable[[LoaderSpec], Any]
    ) -> None:
        self.datamodule, self.spec, self.factory = datamodule, spec, factory
        self.loader: BatchLoader = factory(spec)
        self._stale = False

    def __len__(self) -> int:
        pending = self.datamodule._pending_len(self.spec)
        return pending if pending is not None else len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator: nothing runs until the first next(). Lightning calls iter() once more than
        # it iterates (data_connector._check_dataloader_iterable drops that iterator), and on
        # resume its first next() comes after the loops are restored, when
        # trainer.current_epoch is the epoch that really runs.
        return self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._stale:
            close = getattr(self.loader, "close", None)
            if close is not None:
                close()
            self.loader, self._stale = self.factory(self.spec), False
        epoch, consumed, steps = self.datamodule._start_epoch(self)
        self.loader.set_epoch(epoch, consumed, steps)
        yield from self.loader

    def resize(self, num_workers: int, prefetch_factor: int | None) -> None:
        """Use new worker figures from the next iteration on."""
        workers = replace(self.spec.workers, num_workers=num_workers)
        if prefetch_factor is not None:
            workers = replace(workers, prefetch_factor=prefetch_factor)
        self.spec = replace(self.spec, workers=workers)
        self._stale = True

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
        found = next((s for s in VAL_SPLITS if s in available), None)
        if found:
            names["val"] = found
    if "test" not in names and "test" in available:
        names["test"] = "test"
    for role, split in names.items():
        if split and split not in available:
            raise ValueError(
                f"{role} split {split!r} is not in {manifest.root} (splits: {sorted(available)})"
            )
    return {role: split for role, split in names.items() if split}
