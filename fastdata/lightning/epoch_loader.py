"""The loader Lightning sees (`EpochLoader`), and the training epoch's position it starts
(`EpochPosition`, `fastdata.lightning.position`).

`ShardDataModule` hands each split's backend loader to an `EpochLoader`, which tells the backend,
when iteration starts, which epoch to produce and from which position (a pending resume). The
`EpochPosition` keeps that position as the epoch plan counts it: batches taken, hence the global
samples consumed (`EpochPlan.consumed_after`) that `ShardDataModule.state_dict` records.

Data flows one way: the DataModule makes a loader and hands it what it needs (the spec, the
backend factory, the training position, itself as the holder of the Trainer, read through the
public ``trainer`` attribute only); the loader starts its epochs itself and keeps its own record
(its mode, when it last started and yielded), which the DataModule asks. A loader calls nothing
of the DataModule's. The training position outlives any one loader (a checkpoint is loaded before
Lightning asks for the loader; `reload_dataloaders_every_n_epochs` makes new ones), so the
DataModule creates it once and hands it to every training loader it makes: the loader starts
epochs on it, the DataModule counts the batches that reach the device on it.

A batch carries its origin in its type: `TrainBatch` from the training loader, `EvalBatch` from
an evaluation one (tuple subclasses: Lightning's `transfer_batch_to_device` rebuilds a tuple with
its own type, dropping only instance attributes); a dict dataset's batches are `TrainSample` /
`EvalSample` (dict subclasses, whose type Lightning's transfer keeps the same way). `on_after_batch_transfer` reads the mode, hence
the transforms and whether the batch counts towards the epoch position, from the batch itself, so
a validation run in the middle of a training epoch changes neither.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from fastdata.lightning.position import EpochPosition
from fastdata.read import BatchLoader, LoaderSpec
from fastdata.read.decoders.dict_batch import EvalSample, TrainSample
from fastdata.read.source_ids import SourceIds, load_source_ids

__all__ = [
    "BatchKind",
    "EpochLoader",
    "EpochPosition",
    "EvalBatch",
    "EvalSample",
    "TrainBatch",
    "TrainSample",
    "close_loaders",
    "restored_steps",
]


class TrainBatch(tuple):
    """(images, labels) yielded by a training loader: augmented and counted as trained on.

    With ``keys=True``: (images, labels, ids), ids = ``{"key": [...], "source_id": [...]}``
    (`fastdata.read.source_ids`).
    """

    __slots__ = ()


class EvalBatch(tuple):
    """(images, labels) yielded by an evaluation loader (val, test, predict).

    With ``keys=True``: (images, labels, ids), ids = ``{"key": [...], "source_id": [...]}``
    (`fastdata.read.source_ids`; key and source id None for a padding row).
    """

    __slots__ = ()


@dataclass(frozen=True)
class BatchKind:
    """What a loader says of its batches, which `ShardDataModule.on_after_batch_transfer` reads.

    Attributes:
        normalized: the backend already normalized them (nothing is left to do).
        applied_ops: the leading ops of the preset's list the backend already applied.
        fields: the split's fields (`fastdata.format.fields`; dict batches).
    """

    normalized: bool
    applied_ops: int
    fields: dict[str, Any]


class _Owner(Protocol):
    """What an `EpochLoader` reads of the module that made it: its Trainer (None without one)."""

    trainer: Any


# Orders events across loaders: a loader stamps its starts and yields with the next number, so
# the DataModule can ask which of its loaders started or yielded last.
_EVENTS = itertools.count(1)


class EpochLoader:
    """The loader Lightning sees: hands the epoch and resume position to the backend.

    The backend loader is reused across epochs (`set_epoch`); it is rebuilt only after
    `resize` changed its worker settings. Batches come out as `TrainBatch` or `EvalBatch`.
    The loader holds its DataModule (it may be the only reference, as in
    `ShardDataModule(root).train_dataloader()`); the DataModule holds its loaders weakly, so
    nothing forms a cycle: a loader no longer referenced is collected at once, and its workers are
    stopped with it (`weakref.finalize`), without waiting for a cycle collection.

    Args:
        owner: the DataModule; the loader reads its ``trainer`` (the epoch the Trainer runs, a
            mid-epoch restart, ``overfit_batches``) and nothing else.
        spec: the split's loader spec.
        factory: the backend's loader factory.
        position: a training loader's position, shared with the loaders that come before and
            after it (None: a position of its own). Evaluation loaders have none.

    Attributes:
        position: the training position this loader starts its epochs on (None: evaluation).
        started: when this loader last started an epoch (an increasing event number; 0: never).
        yielded: when this loader last yielded a batch (the same numbering; 0: never).
    """

    def __init__(
        self,
        owner: _Owner,
        spec: LoaderSpec,
        factory: Callable[[LoaderSpec], Any],
        position: EpochPosition | None = None,
    ) -> None:
        self.owner, self.spec, self.factory = owner, spec, factory
        self.position: EpochPosition | None = None
        if spec.train:
            self.position = position if position is not None else EpochPosition(spec.seed)
        self.started = self.yielded = 0
        self.loader: BatchLoader = factory(spec)
        self._kind: BatchKind | None = None  # `batch_kind`, once asked (per backend loader)
        self._stale = False
        self._retired = False  # replaced by a newer loader: close when the iteration ends
        self._ids: SourceIds | None = None  # keys=True: the split's source ids, once read
        self._active: weakref.ref[Generator[Any, None, None]] | None = None
        # What the finalizer closes when this loader is collected (not `self`: that would keep
        # it alive); `_batches` updates it when the backend loader is rebuilt.
        self._backend: dict[str, Any] = {"loader": self.loader}
        weakref.finalize(self, _close_backend, self._backend)

    @property
    def train(self) -> bool:
        """This loader's mode: True for training batches (`TrainBatch`), False for evaluation."""
        return self.spec.train

    @property
    def fields(self) -> dict[str, Any]:
        """The split's fields (`fastdata.format.fields`), which a dict batch's finishing reads."""
        return self.spec.manifest.split(self.spec.split).field_specs

    def batch_kind(self) -> BatchKind:
        """What this loader's batches are (the backend's flags and the split's fields)."""
        # Asked for every batch that reaches the device: built once per backend loader.
        if self._kind is None:
            loader = self.loader
            self._kind = BatchKind(loader.normalized, loader.applied_ops, self.fields)
        return self._kind

    def __len__(self) -> int:
        pending = None
        if self.position is not None:
            pending = self.position.pending_len(self.spec, restored_steps(self._trainer()))
        if pending is not None:
            return pending
        if self.spec.train:
            # A whole epoch: until the next epoch starts, the backend's len() still counts from
            # the position its last epoch started at (a resume), and Lightning reads len() then.
            return len(self.spec.plan(self.spec.epoch))
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator: nothing runs until the first next(). Lightning calls iter() once more than
        # it iterates (data_connector._check_dataloader_iterable drops that iterator), and on
        # resume its first next() comes after the loops are restored, when
        # trainer.current_epoch is the epoch that really runs.
        batches = self._batches()
        self._active = weakref.ref(batches)
        return batches

    def _batches(self) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        if self._stale:
            self._close_backend()
            self.loader, self._stale, self._kind = self.factory(self.spec), False, None
            self._backend["loader"] = self.loader
        ids = self._source_ids() if self.spec.keys else None
        epoch, consumed, steps = self._start()
        self.started = next(_EVENTS)
        self.loader.set_epoch(epoch, consumed, steps)
        kind, sample_kind = (TrainBatch, TrainSample) if self.train else (EvalBatch, EvalSample)
        try:
            for batch in self.loader:
                self.yielded = next(_EVENTS)
                if ids is not None:
                    batch = ids.attach(batch)
                yield sample_kind(batch) if isinstance(batch, dict) else kind(batch)
        finally:
            if self._retired:  # replaced while this iteration ran: its workers go now
                self._retired = False
                self._close_backend()

    def _trainer(self) -> Any:
        return getattr(self.owner, "trainer", None)

    def _start(self) -> tuple[int, int, int]:
        """The (epoch, consumed, steps before) this iteration produces: evaluation, the whole
        split; training, the epoch the Trainer runs (0, 1, 2, ... without one), after a pending
        resume or a Trainer's mid-epoch restart."""
        position = self.position
        if position is None:
            return 0, 0, 0
        trainer = self._trainer()
        if trainer is None:
            return position.start(self.spec, None)
        if trainer.overfit_batches > 0:
            # overfit_batches: the first epoch's batches (and augmentation) every epoch, from its
            # start, also after a resume (a saved position would move the window along).
            position.resume = None
            return position.start(self.spec, 0, 0)
        return position.start(self.spec, trainer.current_epoch, restored_steps(trainer))

    def _source_ids(self) -> SourceIds:
        """The split's source ids (`keys=True`), read once per loader."""
        if self._ids is None:
            spec = self.spec
            self._ids = load_source_ids(spec.manifest, spec.split, spec.cache)
        return self._ids

    @property
    def iterating(self) -> bool:
        """Whether an iteration of this loader has begun (a first batch asked for) and not ended."""
        active = self._active() if self._active is not None else None
        return active is not None and inspect.getgeneratorstate(active) in (
            inspect.GEN_SUSPENDED,
            inspect.GEN_RUNNING,
        )

    def retire(self) -> None:
        """Stop the workers once the iteration in progress ends, or now when none is running.

        A DataModule asked for a new loader of a role while the Trainer iterates the last one (a
        callback reading `len(trainer.datamodule.train_dataloader())`) must not end that epoch.
        """
        if self.iterating:
            self._retired = True
        else:
            self.close()

    def close(self) -> None:
        """Stop this loader's worker processes now (iterating it again starts new ones).

        An iteration in progress ends (its generator is closed), so its workers go with it.
        """
        active = self._active() if self._active is not None else None
        self._active = None
        if active is not None:
            try:
                active.close()
            except ValueError:  # running in another thread: its workers are stopped below
                pass
        self._close_backend()

    def _close_backend(self) -> None:
        _close_backend(self._backend)

    def state_dict(self) -> dict[str, Any]:
        """Empty: the position is `ShardDataModule.state_dict`, which every checkpoint holds.

        Defined so that Lightning counts this loader as resumable and does not warn, at a
        mid-epoch resume, that the dataloader cannot resume.
        """
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: `ShardDataModule.load_state_dict` restores the position."""

    def resize(self, num_workers: int, prefetch_factor: int | None) -> None:
        """Use new worker figures from the next iteration on."""
        workers = replace(self.spec.workers, num_workers=num_workers)
        if prefetch_factor is not None:
            workers = replace(workers, prefetch_factor=prefetch_factor)
        self.spec = replace(self.spec, workers=workers)
        self._stale = True

    def as_dataloader(self) -> DataLoader:
        """This loader as a `torch.utils.data.DataLoader`, for Fabric's `setup_dataloaders`.

        Fabric accepts only DataLoader instances; the Trainer takes this loader itself. Each
        iteration of the result is one epoch of this loader (`fastdata.lightning.compat.FabricLoader`).
        """
        from fastdata.lightning.compat import FabricLoader

        return FabricLoader(self)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_active"] = None  # an iteration in progress does not travel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        weakref.finalize(self, _close_backend, self._backend)

    def __getattr__(self, name: str) -> Any:  # the backend's extras (skipped, ...)
        # Not `dataset`: Lightning would then warn that an IterableDataset's length may be
        # inexact with workers, which this plan's is not.
        if name in ("loader", "dataset", "owner", "_active", "_backend"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def close_loaders(loaders: Mapping[str, EpochLoader]) -> None:
    """Stop the workers of every loader in `loaders` (the loaders stay usable)."""
    for loader in list(loaders.values()):
        loader.close()


def _close_backend(backend: dict[str, Any]) -> None:
    close = getattr(backend["loader"], "close", None)
    if close is not None:
        close()


def restored_steps(trainer: Any) -> int:
    """Batches of the current epoch that a Trainer resuming from a mid-epoch checkpoint counts
    as done (0 without a Trainer, or when it is not resuming mid-epoch).

    Read while Lightning restarts its loops (from `len()` and the epoch's first batch), when
    its epoch loop's batch progress holds the restored count.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not loop.restarting:
        return 0
    return int(loop.batch_progress.current.ready)
