"""The next epoch's first batch of a cpu worker, decoded by a thread while the epoch ends.

A persistent training worker of `fastdata.read.backends.cpu_batches.ShardBatchDataset` starts
one `NextEpochBatch` after its last batch of an epoch; the next epoch takes it instead of
decoding that batch again when it is the epoch foreseen. Plans and augmentation seeds are
functions of the epoch, so the batch is the one decoding it then would give.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from fastdata.read.base import LoaderSpec
from fastdata.read.plan import EpochPlan
from fastdata.read.rows import Skip
from fastdata.read.shardio import ShardReader

__all__ = ["LoadBatch", "NextEpochBatch"]

log = logging.getLogger("fastdata")

#: (reader, plan, batch number, skips) -> the batch: `ShardBatchDataset._load_batch`.
LoadBatch = Callable[[ShardReader, EpochPlan, int, list[Skip]], tuple[torch.Tensor, torch.Tensor]]


class NextEpochBatch:
    """The next epoch's first batch of one worker, decoded by a thread while the epoch ends.

    `take` gives it to the next epoch when that epoch is the one foreseen (epoch + 1, from its
    start): the same batch as decoding it then (plans and augmentation seeds are functions of
    the epoch). Otherwise (another epoch set, a resume) it is dropped, after the thread ends.
    """

    def __init__(self, key: tuple[int, int, int], number: int) -> None:
        self.key, self.number = key, number
        self._result: tuple[tuple[torch.Tensor, torch.Tensor], list[Skip]] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, spec: LoaderSpec, load_batch: LoadBatch, epoch: int, worker: int
    ) -> NextEpochBatch:
        """Start decoding `worker`'s first batch of `epoch` (`load_batch`) on a thread."""
        ahead = cls((epoch, 0, 0), worker)  # a worker's first batch number is its id (rule 6)

        def run() -> None:
            reader = ShardReader(
                spec.manifest,
                spec.split,
                cache=spec.cache,
                verify_samples=spec.verify_samples,
            )
            try:
                plan = spec.plan(epoch)
                if worker < len(plan.rows):
                    skips: list[Skip] = []
                    ahead._result = load_batch(reader, plan, worker, skips), skips
            except BaseException as exc:  # noqa: BLE001 - raised where the batch is taken
                ahead._error = exc
            finally:
                reader.close()

        # A daemon: a worker that exits while it runs is not held up by it.
        ahead._thread = threading.Thread(target=run, name="fastdata-next-epoch", daemon=True)
        ahead._thread.start()
        return ahead

    def take(
        self, key: tuple[int, int, int], timeout: float | None = None
    ) -> tuple[int, tuple[tuple[torch.Tensor, torch.Tensor], list[Skip]]] | None:
        """(batch number, (batch, skips)) when `key` is the epoch foreseen, else None.

        Waits at most `timeout` seconds (None: until the thread ends) for the thread; a thread
        still running then is left behind (a daemon) and the batch is decoded anew.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "the next epoch's first batch of worker %d was not decoded after %s s; "
                    "decoding it again",
                    self.number,
                    timeout,
                )
                return None
        if key != self.key:
            return None
        if self._error is not None:
            raise self._error
        return None if self._result is None else (self.number, self._result)
