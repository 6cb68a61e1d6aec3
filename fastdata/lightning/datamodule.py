"""`ShardDataModule`: the drop-in LightningDataModule over a folder of fastdata shards.

    dm = ShardDataModule("shards/cifar100", batch_size=256)  # workers sized by measuring
    trainer.fit(model, datamodule=dm)          # the model's code does not change

Every backend reads the same epoch plan (`fastdata.read.plan`) and yields uint8 batches, not
normalized, at the output size for the built-in presets; `on_after_batch_transfer` runs the rest
of the transforms and the normalization batched on the training device, after the cheap uint8
copy, seeded per batch from the plan (`prepared`: both, for code that iterates a loader itself). The module keeps its position in
the epoch as global samples consumed (`state_dict`), so a run resumed from a mid-epoch
checkpoint, even with another world size or batch size, continues with exactly the samples not
yet trained on. Splits with fields beyond an image and a label (masks, boxes, multi-labels,
text: `fastdata.format.fields`) yield dict batches (`fastdata.read.decoders.dict_batch`) from the cpu and memory
backends; `fastdata.lightning.family` holds the segmentation and detection members. A list of roots
is a mix of datasets
(`fastdata.read.mix`): each training epoch draws from each in proportion to its weight. Given a
`source=ShardSource(...)`, `prepare_data` writes the shard folder itself
(`fastdata.lightning.prepare`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from fastdata._util.pool import TensorPool
from fastdata._util.threads import one_thread_on_cpu
from fastdata.augment import Preset
from fastdata.format.carve import Carve, carve_fingerprint
from fastdata.format.fields import is_classification
from fastdata.format.manifest import VAL_SPLITS, Manifest, resolve_splits
from fastdata.format.manifest_io import load_manifest
from fastdata.lightning.compat import DATAMODULE_BASES
from fastdata.lightning.dataset_info import DatasetInfo
from fastdata.lightning.epoch_loader import (
    BatchKind,
    EpochLoader,
    EpochPosition,
    EvalBatch,
    TrainBatch,
    close_loaders,
)
from fastdata.lightning.options import (
    CacheSettings,
    RootSpec,
    check_cache_room,
    resolve_groups,
    resolve_roots,
    shard_cache,
)
from fastdata.lightning.prepare import (
    ShardSource,
    await_shards,
    check_recorded,
    check_source,
    load_prepared,
    prepare_shards,
)
from fastdata.lightning.runtime import (
    check_options,
    pick_backend,
    rank_and_world,
    size_workers,
    training_device,
    warn_unit_scale,
)
from fastdata.lightning.transforms import TransformSpec, check_sizes, resolve_transforms
from fastdata.read import BatchLoader, LoaderSpec, WorkerSettings, field_backends, get_backend
from fastdata.read.decoders.dict_batch import EvalSample, TrainSample
from fastdata.read.finish import finish_sample
from fastdata.read.mix import epoch_mix, epoch_size, load_mix
from fastdata.read.resume import ResumeState, dataset_fingerprint, mix_description
from fastdata.read.schedule import MixResume, resume_schedule, schedule_record
from fastdata.read.shuffle import check_shuffle, node_window

__all__ = ["ShardDataModule"]

log = logging.getLogger("fastdata")


class ShardDataModule(DatasetInfo, *DATAMODULE_BASES):
    """A LightningDataModule over a shard folder written by `fastdata shard`.

    It is a `lightning.pytorch` and, where that package is installed, a `pytorch_lightning`
    DataModule (`fastdata.lightning.compat`): either package's Trainer, Tuner and LightningCLI take it.
    `num_classes`, `classes` and `image_shape` (`fastdata.lightning.dataset_info`) read the manifest,
    before `setup()` too.

    Arguments after `root` are keyword-only, and each option has one public way to be set: a
    settings object where it carries several values that belong together (`ShardSet` for a
    dataset and its weight, `workers=` for the loader's processes, `cache=` for a remote cache;
    `fastdata.lightning.options`, after MosaicML Streaming's `Stream`), a flat keyword where one
    value is all there is. A group keeps a concern's values in one place for configs and the
    LightningCLI (``--data.workers.num_workers 4``) and lets it grow without more keywords. So:
    `train_transforms=` (it pairs with `eval_transforms=` and takes more than preset names);
    `ShardSet(root, weight=)` (a weight stays with its dataset, not in a list that must follow
    the roots' order); `splits={"val": NAME}` names a split for any role, and `val=` only
    carves a fraction; `workers=`, `cache=`. $FASTDATA_CACHE_DIR / $FASTDATA_CACHE_LIMIT are
    the cache's values where nothing is given (set once per node), not a second way to pass
    them. The removed aliases are listed in CHANGELOG.md.

    Args:
        root: the shard folder (holding manifest.json), or a URL prefix for remote shards, or a
            `ShardSet`; or a list of them: a mix (`fastdata.read.mix`: each training epoch draws
            from each dataset by its `ShardSet` weight (plain roots: 1.0), classes merged by
            name, evaluation splits concatenated).
        batch_size: samples per batch on each rank.
        backend: a name in `fastdata.read.BACKENDS` or "auto" (memory if its store of the
            training split fits a share of the device's free memory, else a GPU decoder with a
            GPU, else cpu).
        train_transforms: a preset name ("cifar", "photo", "none"), a `fastdata.augment.Preset`,
            or a callable on uint8 (N, 3, H, W) images on the device (e.g. torchvision
            transforms v2, kornia), called per image (own draws, seeded from the plan) at the
            output size (`fastdata.augment.BatchTransform(fn, per_sample=False)`: per batch);
            None: `fastdata.augment.default_preset` ("cifar" for small fixed-size images, else
            "photo"); the eval ops go with it.
        eval_transforms: the same for val/test batches; None: the train preset's eval ops (for a
            callable: none, i.e. normalization only).
        mean: per-channel mean on the 0..255 scale; None: a `Preset` object's own, else the
            training split's, measured by `fastdata shard` (else the preset's).
        std: per-channel std on the 0..255 scale; None: as for `mean`.
        image_size: output side of photos (default 224); None keeps fixed-size data's size.
        seed: base seed of shuffling and augmentation.
        shuffle: the training order (`fastdata.read.shuffle`): "window" (default: rows permuted
            within blocks spanning many shards, sized from what this node holds: a share of the
            free memory for local shards, of the cache limit for remote ones, the whole split
            for the memory backend; rank 0's size is used on every rank and recorded in
            `state_dict`), a window size in samples, "shard" (shard by shard: the cheapest
            reads, for shards shuffled when written, as `fastdata shard` writes them) or
            "full" (a permutation of the split: random reads).
        on_error: "raise" at a corrupt sample, or "skip" it (counted, logged with its key).
        drop_last: drop each epoch's last short training step (all ranks alike).
        splits: split names per role, e.g. {"train": "train", "val": "validation"}, or
            {"val": "test"} to validate on the test split of a dataset without a val split.
        val: a fraction of the training split carved out for validation (e.g. 0.1;
            `fastdata.format.carve`: seeded by the manifest's shard seed, the same rows on every
            rank, world size and run, and never trained on by any backend). None: the split
            `splits` names, else the "val"/"validation" split, else no validation (warned).
        rank: this process's global rank; None: the Trainer's, else torch.distributed's, else 0.
        world_size: ranks; None: the Trainer's, else torch.distributed's, else 1.
        epoch_samples: a mix's samples per training epoch (default: the sum of its datasets'
            training sizes); needs a list `root`.
        decoded_cache_dir: where the memory backend caches decoded splits (None:
            $FASTDATA_CACHE_DIR, else ~/.cache/fastdata/decoded; never the shard folder unless
            passed here).
        verify_samples: hash every sample read and compare it with its digest written at shard
            time (cpu and memory backends; shards without digests are read with a warning).
            Off by default: index checksums, tar headers and labels are checked on every read.
        keys: every batch says which samples it holds (`fastdata.read.source_ids`): dict
            batches gain ``key`` and ``source_id`` lists, classification batches become
            (images, labels, {"key": [...], "source_id": [...]}); None marks padding rows.
        ignore_index: dict batches' mask value (0..65535) of pixels a pad-crop or warp adds
            outside the image and of every pixel of an evaluation padding sample (default 255,
            as in most segmentation losses: pass the same to ``cross_entropy(ignore_index=)``).
        workers: the loader's processes, a `fastdata.read.WorkerSettings`: `num_workers`
            (loader processes, cpu backend), `prefetch_factor` (batches per worker) and
            `decode_threads` (threads decoding a batch's photos in a worker), each a number or
            "auto" (measured from core load and sample cost, `fastdata.tune`; decode threads by
            timing a few pairs on photo splits); `pin_memory`, `persistent_workers`; `timeout`
            (seconds to wait for a worker's batch before an error naming the worker and split;
            0: forever; the default, 600, is far above a batch's time on a slow machine and
            still ends a hung run); `mp_context` (None: "spawn" once CUDA is initialized).
            None: ``WorkerSettings(num_workers="auto", prefetch_factor="auto")``.
        cache: a remote dataset's local shard cache, a `fastdata.lightning.options.CacheSettings`
            (dir, limit such as "50GB"); None, or a field None: $FASTDATA_CACHE_DIR /
            $FASTDATA_CACHE_LIMIT, else ~/.cache/fastdata/shards / 50 GB.
        source: a dataset to shard into `root` in `prepare_data`, a
            `fastdata.lightning.prepare.ShardSource` (kind, path, `ShardOptions`): written
            once (per node, or once in all with ``prepare_data_per_node = False``), resumed
            after a kill, nothing written when `root` holds its shards already; `setup` waits
            for the writer's manifest. None: `root` holds shards already.

    Raises:
        ValueError: an option out of range (names it); a `val` fraction outside (0, 1), or with
            a mix (carve each with `fastdata shard --val-fraction`); a lone weighted ShardSet.
        TypeError: a `val` split name (name it in `splits`), a group of the wrong type.
    """

    def __init__(
        self,
        root: RootSpec,
        *,
        batch_size: int = 256,
        backend: str = "auto",
        train_transforms: TransformSpec | None = None,
        eval_transforms: TransformSpec | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        image_size: int | None = None,
        seed: int = 0,
        shuffle: Literal["window", "shard", "full"] | int = "window",
        on_error: Literal["raise", "skip"] = "raise",
        drop_last: bool = True,
        splits: dict[str, str] | None = None,
        val: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch_samples: int | None = None,
        decoded_cache_dir: str | os.PathLike[str] | None = None,
        verify_samples: bool = False,
        keys: bool = False,
        ignore_index: int = 255,
        workers: WorkerSettings | None = None,
        cache: CacheSettings | None = None,
        source: ShardSource | None = None,
    ) -> None:
        super().__init__()
        self.workers, self.cache = resolve_groups(workers, cache)
        self.verify_samples, self.keys, self.ignore_index = verify_samples, keys, ignore_index
        self.batch_size, self.seed, self.on_error = batch_size, seed, on_error
        self.shuffle = shuffle
        self._shuffle_mode, self._window = check_shuffle(shuffle)  # window None: sized at setup
        self.backend, self.image_size, self.drop_last = backend, image_size, drop_last
        self.rank, self.world_size = rank, world_size
        check_options(self)
        self.roots, self.mixed, self.weights, self.val = resolve_roots(root, epoch_samples, val)
        self.root = self.roots[0] if not self.mixed else f"the mix of {', '.join(self.roots)}"
        if source is not None:
            check_source(source, self.roots, self.mixed)
        self.source = source
        self.epoch_samples = epoch_samples
        self.train_transforms_spec = train_transforms
        self.eval_transforms_spec = eval_transforms
        self.mean, self.std = mean, std
        self.split_names = dict(splits or {})
        self.decoded_cache_dir = None if decoded_cache_dir is None else os.fspath(decoded_cache_dir)
        self._init_runtime(seed)

    def _init_runtime(self, seed: int) -> None:
        """The state that setup, the loaders and their batches fill in later (no option's)."""
        self._carve_seed: int | None = None  # the manifest's shard seed, once loaded
        self.manifest: Manifest | None = None
        self.transforms: Preset | None = None  # resolved in setup
        self.backend_name: str | None = None
        # train? -> what the last loader made for that mode said of its batches, and that mode:
        # the answers for batches that outlive their loader (`_batch_kind`, `_is_training`).
        self._made: dict[bool, BatchKind] = {}
        self._made_last = False
        self._position = EpochPosition(seed)
        self._mix_resume: MixResume | None = None  # a scheduled mix's resumed block and splice
        self._mix_resume_of: ResumeState | None = None  # the state it was computed from
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pool = TensorPool()  # CPU batches: reuse released memory instead of page-faulting
        # At most one loader (one set of workers) per split; stopped when the module goes.
        # role -> its loader, held weakly (the loader holds this module: no cycle).
        self._loaders: weakref.WeakValueDictionary[str, EpochLoader] = weakref.WeakValueDictionary()
        # Loaders replaced while they were being iterated: they stop when that iteration ends.
        self._retired: weakref.WeakSet[EpochLoader] = weakref.WeakSet()
        self._cache: Any = None

    # ------------------------------------------------------------------ setup

    def prepare_data(self) -> None:
        """Shard `source` into `root` unless it holds its shards (`fastdata.lightning.prepare`);
        nothing without a `source`. The Trainer calls it on one rank per node (or one in all);
        without a Trainer, call it before `setup` on one rank per node.

        Raises:
            fastdata.lightning.prepare.SourceMismatchError: `root` holds shards of another
                source or other options (names both).
        """
        if self.source is not None:
            self._described = None  # read the manifest written (or found) now
            prepare_shards(self.source, self.root, progress=self._rank_world()[0] == 0)

    def setup(self, stage: str | None = None) -> None:
        """Load the manifest and resolve splits, transforms and backend (idempotent); with a
        `source`, wait for the manifest that `prepare_data` writes (bounded)."""
        if self.manifest is not None:
            return
        if self.source is not None:
            if self._trainer_or_none() is None and self._rank_world()[1] == 1:
                load_prepared(self.source, self.root)  # no writer to wait for: say what to call
            else:
                await_shards(self.source, self.root)
        self.manifest = self._load_manifest()
        if self.source is not None:
            check_recorded(self.source, self.manifest, self.root)
        self.split_names = resolve_splits(self.manifest, self.split_names, self.val)
        self._carve_seed = self.manifest.seed
        own_val = [name for name in VAL_SPLITS if name in self.manifest.splits]
        if isinstance(self.val, float) and own_val:
            log.warning(
                "%s has a %r split, but val=%r validates on a carve of the training split "
                "instead (pass val=%r to use it)",
                self.root,
                own_val[0],
                self.val,
                own_val[0],
            )
        train = self.manifest.split(
            self.split_names.get("train") or next(iter(self.manifest.splits))
        )
        chosen, self.image_size = self._default_transforms(train.raw_shape)
        # A Preset object carries the statistics its author chose; names and callables get the
        # dataset's own (measured by `fastdata shard`), where the manifest has them.
        own = isinstance(chosen, Preset)
        warn_unit_scale(self.mean, self.std)
        mean = self.mean if self.mean is not None or own else train.pixel_mean
        std = self.std if self.std is not None or own else train.pixel_std
        self.transforms = resolve_transforms(
            chosen, self.eval_transforms_spec, self.image_size, mean, std
        )
        roles = {role: self.manifest.split(name) for role, name in self.split_names.items()}
        # Dict datasets: every op is a region that ends at the output size (`samples`).
        check_sizes(
            self.transforms,
            {r: i for r, i in roles.items() if is_classification(i.field_specs)},
            self.image_size,
        )
        self._check_fields(roles)
        self.backend_name = self._choose_backend()
        self._refuse_backend(roles)
        trainer = self._trainer_or_none()
        check_cache_room(
            self._shard_cache(),
            self.manifest,
            list(self.split_names.values()),
            trainer.num_devices if trainer is not None else None,
            self.workers.num_workers,
            self.workers.persistent_workers,
        )
        if self._position.resume is not None:
            self._check_resume(self._position.resume)

    def _check_fields(self, roles: dict[str, Any]) -> None:
        """A family member's check that its splits hold its target (`fastdata.lightning.family`)."""

    def _refuse_backend(self, roles: dict[str, Any]) -> None:
        """Refuse a backend that cannot carry a split's fields (dali, nvjpeg: image + label)."""
        carriers = field_backends()
        if self.backend_name in carriers:
            return
        for role, info in roles.items():
            if not is_classification(info.field_specs):
                fields = ", ".join(f"{n} ({f.kind})" for n, f in info.field_specs.items())
                raise ValueError(
                    f"backend={self.backend_name!r} reads an image and a label only, but the "
                    f"{role} split {self.split_names[role]!r} of {self.root} holds {fields}; "
                    f"use backend={' or '.join(map(repr, sorted(carriers)))} (or 'auto'), "
                    "which carry every field"
                )

    def _read_manifest(self) -> Manifest:
        if self.mixed:
            return load_mix(self.roots, self.weights, self.epoch_samples)
        if self.source is not None:
            return load_prepared(self.source, self.root)
        return load_manifest(self.root)

    def _choose_backend(self) -> str:
        # Every split this module may read (setup resolves the backend once, for every stage):
        # a val-only dataset decides on its val split.
        splits = list(dict.fromkeys(self.split_names.values())) or ["train"]
        trainer = self._trainer_or_none()
        return pick_backend(
            self.backend, self.manifest, splits, self.image_size, self.transforms, trainer
        )

    # ------------------------------------------------------------------ loaders

    def train_dataloader(self) -> BatchLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> BatchLoader | list:
        self.setup()
        if "val" not in self.split_names:
            log.warning(
                "%s has no validation split (splits: %s): validation is skipped, so a "
                "monitored 'val/...' metric never exists. Pass val=0.1 to carve a tenth of the "
                "training split out for validation, splits={'val': 'test'} to "
                "validate on the test split, "
                "or write one with `fastdata shard ... --val-fraction 0.1`.",
                self.root,
                sorted(self.manifest.splits),
            )
            return []  # Lightning runs no validation batch; never the training split
        return self._loader("val", train=False)

    def test_dataloader(self) -> BatchLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> BatchLoader:
        return self._loader("test", train=False, slot="predict")  # not closing test's loader

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
            epoch=self._position.epoch,
            rank=rank,
            world_size=world,
            image_size=self.image_size,
            on_error=self.on_error,
            device=str(self._device()),
            drop_last=self.drop_last and train,
            cache=self._shard_cache(),
            mix=epoch_mix(self.manifest, split, self._mix_resume) if train else None,
            carve=self._carve(role),
            decoded_cache_dir=self.decoded_cache_dir,
            verify_samples=self.verify_samples,
            ignore_index=self.ignore_index,
            keys=self.keys,
            shuffle=self._shuffle_mode,
            window=self._train_window(split) if train else None,
        )
        return self._size_workers(spec)

    def _train_window(self, split: str) -> int | None:
        """The "window" shuffle's size: given, restored, else sized on rank 0 for every rank."""
        if self._shuffle_mode == "window" and self._window is None:
            resident = self.backend_name == "memory"
            window = node_window(self.manifest, split, self._shard_cache(), resident)
            trainer = self._trainer_or_none()
            if trainer is not None and trainer.world_size > 1:
                window = int(trainer.strategy.broadcast(window, src=0))  # part of the order
            self._window = window
        return self._window

    def _loader(self, role: str, train: bool, slot: str | None = None) -> BatchLoader:
        spec = self.loader_spec(role, train)
        # A new loader of a slot replaces the last one: its workers stop now (or, if it is being
        # iterated, when that iteration ends), not at garbage collection: loaders requested every
        # epoch would otherwise pile up worker processes. Keyed by slot (the role, or "predict"),
        # not split: val= may read the training split (a carve) or the test one.
        slot = slot or role
        previous = self._loaders.pop(slot, None)
        if previous is not None:
            previous.retire()
            if previous.iterating:
                self._retired.add(previous)  # teardown still stops it
        position = self._position if train else None  # one position for every training loader
        loader = EpochLoader(self, spec, self._loader_factory(), position)
        self._loaders[slot] = loader  # weakly: a loader nobody holds is collected, workers and all
        self._made[train], self._made_last = loader.batch_kind(), train
        return loader

    def _loader_factory(self) -> Any:
        """spec -> the backend's loader (a family member reading other samples overrides it)."""
        return get_backend(self.backend_name).load()

    def __getstate__(self) -> dict[str, Any]:
        # Loaders (and their workers) do not travel: a copy or an unpickled module makes its own.
        state = dict(self.__dict__)
        state["_loaders"] = state["_retired"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._loaders = weakref.WeakValueDictionary()
        self._retired = weakref.WeakSet()

    def teardown(self, stage: str | None = None) -> None:
        """Stop every loader's worker processes (Lightning calls this after fit, test, ...).

        The loaders stay usable: iterating one again starts its workers anew.
        """
        close_loaders(self._loaders)
        for loader in list(self._retired):
            loader.close()
        if self._cache is not None:
            self._cache.trim()  # workers stopped mid-epoch release their pins without trimming

    def _shard_cache(self) -> Any:
        if self._cache is None:
            self._cache = shard_cache(self.roots, self.cache)
        return self._cache

    def resize_workers(self, num_workers: int, prefetch_factor: int | None = None) -> None:
        """Change the loader processes from the next epoch on (used by `LoaderMonitor`)."""
        if num_workers < 0 or (prefetch_factor is not None and prefetch_factor < 1):
            raise ValueError(
                f"need num_workers >= 0 and prefetch_factor >= 1, got {num_workers}, {prefetch_factor}"
            )
        self.workers = replace(self.workers, num_workers=num_workers)
        if prefetch_factor is not None:
            self.workers = replace(self.workers, prefetch_factor=prefetch_factor)
        for loader in list(self._loaders.values()):
            loader.resize(num_workers, prefetch_factor)

    def _size_workers(self, spec: LoaderSpec) -> LoaderSpec:
        return size_workers(spec, self.workers, self.backend_name, self._trainer_or_none())

    # ------------------------------------------------------------------ device augmentation

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Run the transforms the loader left (training: seeded from the plan) on the device.

        A dict dataset's batch (`TrainSample` / `EvalSample`, `fastdata.read.decoders.dict_batch`) gets the
        regions its loader left (the memory backend: image, masks and boxes moved together,
        `fastdata.read.finish.finish_sample`) and its image normalized; its other fields pass
        as they are (`keys=True`'s ``key`` and ``source_id`` too). An (images, labels, ids)
        batch (`keys=True`) keeps its ids. Anything else but such a batch passes unchanged:
        Lightning also sends the model's `example_input_array` through this hook (for the model
        summary).
        """
        if isinstance(batch, Mapping):
            return self._finish_sample(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) in (2, 3)):
            return batch
        x, y, *ids = batch  # ids: keys=True's {"key": ..., "source_id": ...}
        if ids and not isinstance(ids[0], Mapping):
            return batch
        train = self._is_training(batch)
        seed = self._position.next_batch_seed() if train else self.seed
        kind = self._batch_kind(train)
        normalized, applied = (kind.normalized, kind.applied_ops) if kind else (False, 0)
        if normalized or x.is_floating_point():
            return (x, y, *ids)
        self.setup()
        with one_thread_on_cpu(x.device):
            generator = self._generator(x.device).manual_seed(seed)
            x = self.transforms.apply(x, train, generator, self._pool, skip=applied)
        return (x, y, *ids)

    def _finish_sample(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """A dict batch's device work: the regions the loader left (memory backend: drawn from
        the plan's batch seed, moving image, masks and boxes together), then normalizing."""
        image = batch.get("image")
        if not isinstance(image, torch.Tensor) or image.is_floating_point():
            return batch  # not one of ours, or already finished
        train = self._is_training(batch)
        seed = self._position.next_batch_seed() if train else self.seed
        kind = self._batch_kind(train)
        applied, fields = (kind.applied_ops, kind.fields) if kind else (0, {})
        self.setup()
        with one_thread_on_cpu(image.device):
            out = finish_sample(
                batch, fields, self.transforms, train, seed, applied, self.ignore_index
            )
            out["image"] = self.transforms.apply(
                out["image"], train, None, self._pool, skip=len(self.transforms.ops(train))
            )
        return out

    def prepared(
        self, loader: Iterable[Any], device: torch.device | str | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`loader`'s uint8 batches as the model gets them (moved to `device`, default the training
        device, and finished by `on_after_batch_transfer`), for code that iterates a loader itself:
        ``torch.optim.swa_utils.update_bn(dm.prepared(dm.train_dataloader()), model)``. Dict
        batches come out as dicts (`TrainSample` / `EvalSample`) with their targets moved too."""
        target = torch.device(device) if device is not None else self._device()
        for batch in loader:
            yield self.on_after_batch_transfer(self.transfer_batch_to_device(batch, target, 0), 0)

    def _is_training(self, batch: Any = None) -> bool:
        """Whether `batch` is a training batch: its type says so (`TrainBatch`, `EvalBatch`);
        for a tuple rebuilt by other code, the Trainer's state, else the mode of the loader that
        yielded the latest batch (asked of the loaders; once they are gone, the mode of the last
        one made)."""
        if isinstance(batch, (TrainBatch, EvalBatch, TrainSample, EvalSample)):
            return isinstance(batch, (TrainBatch, TrainSample))
        trainer = self._trainer_or_none()
        if trainer is not None:
            return bool(trainer.training)
        yielded = [loader for loader in self._live_loaders() if loader.yielded]
        if yielded:
            return max(yielded, key=lambda loader: loader.yielded).train
        return self._made_last

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The position in the training epoch (`fastdata.read.resume.ResumeState`; in checkpoints)."""
        self.setup()
        split = self.split_names.get("train", "train")
        _, world = self._rank_world()
        position = self._position
        state = ResumeState(
            epoch=position.epoch,
            consumed=position.consumed(),
            steps=position.batches,
            seed=self.seed,
            world_size=world,
            batch_size=self.batch_size,
            num_samples=self._epoch_size(self.manifest, split),
            dataset=carve_fingerprint(dataset_fingerprint(self.manifest, split), self._carve()),
            mix=mix_description(self.manifest, split),
            shuffle=f"window:{self._train_window(split)}"
            if self._shuffle_mode == "window"
            else self._shuffle_mode,
            schedule=schedule_record(
                epoch_mix(self.manifest, split, self._mix_resume),
                self.seed,
                position.epoch,
                position.consumed(),
                self.batch_size,
            ),
        )
        return state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the training epoch `epoch`, when it runs, starts after the consumed samples.

        Raises:
            fastdata.read.resume.ResumeError: the state belongs to another dataset, mix or seed, was
                saved by an older fastdata, or is malformed (the message names the field).
        """
        state = ResumeState.from_dict(state_dict)
        self._check_resume(state)
        self._window = state.resumed_window(self._shuffle_mode, self._window)
        self._position.restore(state)

    def _check_resume(self, state: ResumeState) -> None:
        manifest = self.manifest or self._load_manifest()
        split = self.split_names.get("train", "train")
        if split not in manifest.splits:
            return  # checked again in setup, once the split names are resolved
        carve = self._carve(seed=manifest.seed)
        state.check(
            self.seed,
            self._epoch_size(manifest, split, carve),
            carve_fingerprint(dataset_fingerprint(manifest, split), carve),
            mix_description(manifest, split),
        )
        # A scheduled mix: its block, and a changed schedule's splice (here, not in
        # load_state_dict alone: a state loaded before setup resolved the split comes here again).
        if self._mix_resume_of is not state:  # once a state (its warning, if any, once)
            self._mix_resume = resume_schedule(epoch_mix(manifest, split), self.seed, state)
            self._mix_resume_of = state

    # ------------------------------------------------------------------ val carve

    def _carve(self, role: str = "train", seed: int | None = None) -> Carve | None:
        """The side of the `val=` carve that `role` reads (None: no carve, or another role)."""
        if not isinstance(self.val, float) or role not in ("train", "val"):
            return None
        seed = self._carve_seed if seed is None else seed
        assert seed is not None, "the carve seed comes from the manifest (setup)"
        return Carve(self.val, seed, "val" if role == "val" else "train")

    def _epoch_size(self, manifest: Manifest, split: str, carve: Carve | None = None) -> int:
        """Samples in a training epoch, after the carve."""
        carve = carve or self._carve()
        if carve is None:
            return epoch_size(manifest, split)
        return carve.count(manifest.split(split).num_samples)

    # ------------------------------------------------------------------ helpers

    def _trainer_or_none(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def _rank_world(self) -> tuple[int, int]:
        return rank_and_world(self.rank, self.world_size, self._trainer_or_none())

    def _device(self) -> torch.device:
        return training_device(self._trainer_or_none())

    def _live_loaders(self) -> list[EpochLoader]:
        """This module's loaders still alive (replaced ones still iterating included)."""
        return [*self._loaders.values(), *self._retired]

    def _batch_kind(self, train: bool) -> BatchKind | None:
        """What the batches of mode `train` are (normalized? ops applied, fields): asked of the
        loader of that mode that started an epoch last, or, for a batch that outlived its loader
        (``next(iter(dm.train_dataloader()))``), remembered from the last one made."""
        started = [
            loader for loader in self._live_loaders() if loader.train == train and loader.started
        ]
        if started:
            return max(started, key=lambda loader: loader.started).batch_kind()
        return self._made.get(train)
