"""The CPU backend: shards -> epoch plan -> decode in DataLoader workers -> uint8 batches.

Each worker builds whole batches of the plan (read -> decode -> collate), so the main process
receives one pinned uint8 tensor per batch and does no per-sample work. A raw split's batch is
gathered in array operations (`raw_shard.gather_raw_batch`); persistent workers hand batches
over through reused shared-memory slots (`fastdata.read.transport.slots`) and keep their open local
shards from epoch to epoch. Encoded photos get the
preset's decode-time crop (and flip) while decoding (`Preset.decode_crop`); everything else runs
later, batched, on the training device (`ShardDataModule.on_after_batch_transfer`).

The epoch and the resume position live in a small shared-memory tensor, so persistent workers
see a new epoch without being restarted. A persistent training worker decodes its first batch of
the next epoch in a thread as soon as it has made its last one (`_Ahead`), so its core does not
idle while the epoch ends; the batch is used only if the next epoch is the one foreseen.

Workers never outlive the training process: each asks Linux to kill it when its parent dies
(`PR_SET_PDEATHSIG`), and a watchdog thread (every platform) ends it within a second of the
parent's death, whatever the worker is blocked on. `CpuLoader.close` stops them at once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from fastdata.read.backends.cpu_batches import STATE_SLOTS, ShardBatchDataset
from fastdata.read.base import LoaderSpec, PlannedLoader
from fastdata.read.plan import EpochPlan
from fastdata.read.transport.slots import BatchSlots, SlotRef
from fastdata.read.transport.stage_times import BatchStages
from fastdata.read.transport.workers import worker_init

__all__ = ["CpuLoader", "LoaderTimeoutError", "make_cpu_loader"]

log = logging.getLogger("fastdata")

_EPOCH, _CONSUMED, _STEPS, _SKIPS = STATE_SLOTS


class LoaderTimeoutError(RuntimeError):
    """No batch came from a loader worker within the loader's timeout."""


class CpuLoader(PlannedLoader):
    """A DataLoader over `ShardBatchDataset` with an exact length and epoch control.

    Attributes:
        normalized: always False (uint8 batches; the rest runs on the device).
        applied_ops: preset ops fused into decoding.
        dataset: the ShardBatchDataset.
        dataloader: the underlying torch DataLoader.
        last_stages: the read and decode seconds of the batch yielded last (None: unknown).
    """

    #: What the workers iterate (the video backend's loader gives its clip dataset).
    dataset_type: type[ShardBatchDataset] = ShardBatchDataset

    def __init__(self, spec: LoaderSpec) -> None:
        self.dataset = self.dataset_type(spec)
        self.applied_ops = self.dataset.applied_ops
        w = spec.workers
        pin = torch.cuda.is_available() if w.pin_memory is None else w.pin_memory
        context = w.mp_context
        if context is None and w.num_workers > 0 and torch.cuda.is_initialized():
            context = "spawn"  # forking a process with a CUDA context is unsafe
        self.dataloader = DataLoader(
            self.dataset,
            batch_size=None,  # the dataset yields whole batches
            num_workers=w.num_workers,
            pin_memory=pin,
            prefetch_factor=w.prefetch_factor if w.num_workers > 0 else None,
            persistent_workers=w.num_workers > 0 and w.persistent_workers is not False,
            timeout=w.timeout if w.num_workers > 0 else 0,
            multiprocessing_context=context if w.num_workers > 0 else None,
        )

        self._iterator: weakref.ref[Any] | None = None
        self.last_stages: BatchStages | None = None
        self._pin = bool(pin) and torch.cuda.is_available()  # slots pin CUDA memory only
        shape = self.dataset.image_shape()
        if self.dataloader.persistent_workers and shape is not None and self._pin == bool(pin):
            # Persistent workers only: one iterator at a time, whose workers write in turn.
            depth = w.prefetch_factor + 2  # in flight per worker, + one being copied out
            self.dataset.slots = BatchSlots.create(w.num_workers, depth, spec.batch_size, shape)
        self.start_at(spec)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The workers read the plan's position from `dataset.state` (`_select`), not `plan`.
        # Read when workers start (the first iteration, or every one without persistence).
        # The parent-death signal is sent when the *thread* that started the worker ends, so it
        # is asked for only when that is the main thread; the watchdog covers the rest.
        main = threading.current_thread() is threading.main_thread()
        self.dataloader.worker_init_fn = functools.partial(worker_init, os.getpid(), main)
        iterator = iter(self.dataloader)
        self._iterator = weakref.ref(iterator)
        return self._batches(iterator, plan.epoch)

    def _batches(self, iterator: Any, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        number = 0  # the DataLoader hands the workers' batches over in the plan's order
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc) or self.spec.workers.num_workers == 0:
                    raise
                raise self._timeout_error(iterator) from exc
            if isinstance(batch, SlotRef):
                assert self.dataset.slots is not None
                batch = self.dataset.slots.take(batch, self._pin)
            elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], SlotRef):
                assert self.dataset.slots is not None  # (ref, keys): `LoaderSpec.keys`
                batch = (*self.dataset.slots.take(batch[0], self._pin), *batch[1:])
            self.last_stages = self.dataset.stage_times.take(epoch, number)
            number += 1
            yield batch

    def _timeout_error(self, iterator: Any) -> LoaderTimeoutError:
        task = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", -1))
        worker = f"worker {task[0]}" if task else "a worker"
        return LoaderTimeoutError(
            f"no batch from {worker} of the {self.spec.split!r} loader "
            f"({self.spec.manifest.root}) within {self.spec.workers.timeout:g} s (WorkerSettings.timeout):"
            " the worker is stuck or far slower than expected (a stalled remote read, an "
            "overloaded machine); raise WorkerSettings.timeout, or pass 0 to wait forever"
        )

    def close(self) -> None:
        """Stop the worker processes now (idempotent; iterating again starts new ones)."""
        iterators = [self.dataloader._iterator]
        if self._iterator is not None:
            iterators.append(self._iterator())
        self.dataloader._iterator, self._iterator = None, None
        for iterator in {id(it): it for it in iterators if it is not None}.values():
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:  # a multiprocessing iterator
                shutdown()

    def _select(self, epoch: int, consumed: int, steps_before: int) -> None:
        # Shared memory: (persistent) workers see the new epoch and position.
        self.dataset.state[_EPOCH] = epoch
        self.dataset.state[_CONSUMED] = consumed
        self.dataset.state[_STEPS] = steps_before

    @property
    def skipped(self) -> int:
        """Samples skipped under on_error='skip' so far (all workers)."""
        return int(self.dataset.state[_SKIPS:].sum())


def make_cpu_loader(spec: LoaderSpec) -> CpuLoader:
    """The CPU backend's loader for one split on one rank."""
    return CpuLoader(spec)
