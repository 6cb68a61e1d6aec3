"""The loader Lightning sees (`EpochLoader`) and the training epoch's position (`EpochPosition`).

`ShardDataModule` hands each split's backend loader to an `EpochLoader`, which tells the backend,
when iteration starts, which epoch to produce and from which position (a pending resume). The
`EpochPosition` keeps that position as the epoch plan counts it: batches taken, hence the global
samples consumed (`EpochPlan.consumed_after`) that `ShardDataModule.state_dict` records.

A batch carries its origin in its type: `TrainBatch` from the training loader, `EvalBatch` from
an evaluation one (tuple subclasses: Lightning's `transfer_batch_to_device` rebuilds a tuple with
its own type, dropping only instance attributes); a dict dataset's batches are `TrainSample` /
`EvalSample` (dict subclasses, whose type Lightning's transfer keeps the same way). `on_after_batch_transfer` reads the mode, hence
the transforms and whether the batch counts towards the epoch position, from the batch itself, so
a validation run in the middle of a training epoch changes neither.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from fastdata.read import BatchLoader, LoaderSpec
from fastdata.read.decoders.dict_batch import EvalSample, TrainSample
from fastdata.read.plan import EpochPlan, batch_seed
from fastdata.read.resume import ResumeState
from fastdata.read.source_ids import SourceIds, load_source_ids

__all__ = [
    "EpochLoader",
    "EpochPosition",
    "EvalBatch",
    "EvalSample",
    "TrainBatch",
    "TrainSample",
    "close_loaders",
    "restored_steps",
]

log = logging.getLogger("fastdata")


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


class _Owner(Protocol):
    """What an `EpochLoader` asks of its DataModule."""

    def _start_epoch(self, loader: EpochLoader) -> tuple[int, int, int]: ...

    def _pending_len(self, spec: LoaderSpec) -> int | None: ...

    def _restored_steps(self) -> int: ...

    def _yielded(self, train: bool) -> None: ...


class EpochPosition:
    """Where training is: the epoch, the batches each rank took, the plan, a pending resume.

    Args:
        seed: the DataModule's base seed (batch seeds outside a plan derive from it).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch, self.batches = 0, 0
        self.plan: EpochPlan | None = None
        self.resume: ResumeState | None = None
        self._manual_epoch = -1

    def start(
        self, spec: LoaderSpec, trainer_epoch: int | None, restored_steps: int = 0
    ) -> tuple[int, int, int]:
        """Begin a training epoch: (epoch, consumed, steps before) the backend must produce.

        Args:
            spec: the training loader's spec (its plan is kept for the batch seeds).
            trainer_epoch: the Trainer's current epoch; None without a Trainer (0, 1, 2, ...).
            restored_steps: batches of this epoch a Trainer restored from a checkpoint counts
                as taken. Without a data position for the epoch (a checkpoint lacking this
                DataModule's entry) the whole epoch runs after them, with a warning: its samples
                before the checkpoint are trained twice, none is skipped.
        """
        if trainer_epoch is None:
            self._manual_epoch += 1
            trainer_epoch = self._manual_epoch
        consumed = steps = 0
        if self.resume is not None and self.resume.epoch == trainer_epoch:
            consumed, steps = self.resume.consumed, self.resume.steps
        elif 0 < restored_steps < len(spec.plan(trainer_epoch)):
            log.warning(
                "the checkpoint resumes epoch %d after %d batches but holds no data position of "
                "the ShardDataModule (its entry is missing): the epoch restarts from its first "
                "sample, so the samples of those %d batches are trained twice and none is "
                "skipped. Checkpoints saved by Lightning with this DataModule hold the entry.",
                trainer_epoch,
                restored_steps,
                restored_steps,
            )
            steps = restored_steps
        self.resume = None
        self.epoch, self.batches = trainer_epoch, steps
        self.plan = spec.plan(trainer_epoch, consumed, steps)
        return trainer_epoch, consumed, steps

    def restore(self, state: ResumeState) -> None:
        """Resume from `state` when its epoch next starts."""
        self.resume = state
        self.epoch, self.batches = state.epoch, state.steps
        # Without a Trainer epochs are counted here: the next one started is the saved one.
        self._manual_epoch = state.epoch - 1

    def pending_len(self, spec: LoaderSpec, restored_steps: int = 0) -> int | None:
        """len() of the training loader while a resume is pending (before the epoch starts).

        Without a data position but with `restored_steps` (see `start`) restored by a Trainer:
        those steps and a whole epoch after them.

        Lightning reads len() once per `fit` and keeps it for every later epoch, so this is the
        larger of the resumed epoch's batches (steps taken + remaining) and a whole epoch's:
        after a resume with another world size x batch size the resumed epoch's count may be
        smaller and would cut every later epoch short. A loader that ends before len() batches
        just ends Lightning's epoch there.
        """
        if not spec.train:
            return None
        if self.resume is None:
            whole = len(spec.plan(spec.epoch))
            return restored_steps + whole if 0 < restored_steps < whole else None
        state = self.resume
        resumed = len(spec.plan(state.epoch, state.consumed, state.steps))
        return max(resumed, len(spec.plan(state.epoch)))

    def next_batch_seed(self) -> int:
        """The augmentation seed of the next training batch (plan rule 5); counts the batch."""
        plan, number = self.plan, self.batches
        self.batches += 1
        if plan is not None and 0 <= number - plan.steps_before < len(plan.seeds):
            return plan.seeds[number - plan.steps_before]
        # A batch no plan covers (a loader iterated outside `EpochLoader`): the plan's own seed
        # derivation, at a position no planned batch starts at.
        return batch_seed(self.seed, self.epoch, -1 - number)

    def consumed(self) -> int:
        """Global samples of the epoch consumed so far (all ranks together)."""
        if self.plan is not None:
            return self.plan.consumed_after(self.batches - self.plan.steps_before)
        return self.resume.consumed if self.resume is not None else 0


class EpochLoader:
    """The loader Lightning sees: hands the epoch and resume position to the backend.

    The backend loader is reused across epochs (`set_epoch`); it is rebuilt only after
    `resize` changed its worker settings. Batches come out as `TrainBatch` or `EvalBatch`.
    The loader holds its DataModule (it may be the only reference, as in
    `ShardDataModule(root).train_dataloader()`); the DataModule holds its loaders weakly, so
    nothing forms a cycle: a loader no longer referenced is collected at once, and its workers are
    stopped with it (`weakref.finalize`), without waiting for a cycle collection.

    Args:
        owner: the DataModule (starts epochs, knows a pending resume).
        spec: the split's loader spec.
        factory: the backend's loader factory.
    """

    def __init__(
        self, owner: _Owner, spec: LoaderSpec, factory: Callable[[LoaderSpec], Any]
    ) -> None:
        self.owner, self.spec, self.factory = owner, spec, factory
        self.loader: BatchLoader = factory(spec)
        self._stale = False
        self._retired = False  # replaced by a newer loader: close when the iteration ends
        self._ids: SourceIds | None = None  # keys=True: the split's source ids, once read
        self._active: weakref.ref[Generator[Any, None, None]] | None = None
        # What the finalizer closes when this loader is collected (not `self`: that would keep
        # it alive); `_batches` updates it when the backend loader is rebuilt.
        self._backend: dict[str, Any] = {"loader": self.loader}
        weakref.finalize(self, _close_backend, self._backend)

    def __len__(self) -> int:
        pending = self.owner._pending_len(self.spec)
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
            self.loader, self._stale = self.factory(self.spec), False
            self._backend["loader"] = self.loader
        owner = self.owner
        ids = self._source_ids() if self.spec.keys else None
        epoch, consumed, steps = owner._start_epoch(self)
        self.loader.set_epoch(epoch, consumed, steps)
        kind, train = (TrainBatch, True) if self.spec.train else (EvalBatch, False)
        sample_kind = TrainSample if train else EvalSample
        try:
            for batch in self.loader:
                owner._yielded(train)
                if ids is not None:
                    batch = ids.attach(batch)
                yield sample_kind(batch) if isinstance(batch, dict) else kind(batch)
        finally:
            if self._retired:  # replaced while this iteration ran: its workers go now
                self._retired = False
                self._close_backend()

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
