"""`StageTimes`: each batch's read and decode seconds, from where it was made to where it is used.

A loader worker (or the training process, with 0 workers) makes batch `number` of an epoch's
plan: it reads the rows' bytes, then decodes and collates them. `record` writes the two
durations into a small shared-memory table (a ring of `RING` rows of epoch, number, read_s,
decode_s) before the batch is handed over; the training process, on receiving batch `number`,
`take`s that row. Nothing is added to the batch itself and no lock or queue is involved: a row
is written before its batch leaves the worker, so it is complete when the batch arrives. A row
overwritten by a batch `RING` places later (or a next-epoch batch decoded ahead) no longer names
the batch asked for, and `take` answers None rather than another batch's figures.

Cost: two `time.perf_counter` reads and one 4-float row write per batch in the worker, one
4-float row read in the training process.
"""

from __future__ import annotations

import time

import torch

__all__ = ["RING", "BatchStages", "StageClock", "StageTimes"]

#: Rows of the ring: far more than the batches in flight (workers x prefetch_factor).
RING = 256


class BatchStages(tuple):
    """(read_s, decode_s) of one batch: where its maker spent its time."""

    __slots__ = ()

    def __new__(cls, read_s: float, decode_s: float) -> BatchStages:
        return super().__new__(cls, (read_s, decode_s))

    @property
    def read_s(self) -> float:
        """Seconds reading the batch's bytes (shard reads, raw-array gathers)."""
        return self[0]

    @property
    def decode_s(self) -> float:
        """Seconds decoding and collating them (and the worker-side crops of photos)."""
        return self[1]


class StageTimes:
    """The shared ring of per-batch stage times of one loader (see the module docstring)."""

    def __init__(self, ring: int = RING) -> None:
        if ring < 1:
            raise ValueError(f"the ring needs at least one row, got {ring}")
        self.table = torch.full((ring, 4), -1.0, dtype=torch.float64).share_memory_()

    def _row(self, epoch: int, number: int) -> int:
        # Epochs are offset so that a next-epoch batch decoded ahead does not land on a batch
        # of the current epoch still in flight (the first batches of an epoch vs its last).
        return (number + epoch * (RING // 2 + 1)) % self.table.shape[0]

    def record(self, epoch: int, number: int, read_s: float, decode_s: float) -> None:
        """Write batch `number` of `epoch`'s stage times (in the process that made it)."""
        row = self.table.numpy()[self._row(epoch, number)]
        row[2], row[3] = read_s, decode_s
        row[0], row[1] = epoch, number  # last: the row names the batch once its times are in

    def take(self, epoch: int, number: int) -> BatchStages | None:
        """Batch `number` of `epoch`'s stage times, or None when its row holds another batch."""
        e, n, read_s, decode_s = self.table.numpy()[self._row(epoch, number)].tolist()
        if e != epoch or n != number:
            return None
        return BatchStages(read_s, decode_s)


class StageClock:
    """Times one batch's making: `read_done()` after its bytes are read, `stages()` at the end."""

    __slots__ = ("_read", "_start")

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._read: float | None = None

    def read_done(self) -> None:
        """Mark the end of reading (the rest is decoding)."""
        self._read = time.perf_counter()

    def stages(self) -> BatchStages:
        """(read_s, decode_s) so far; without a `read_done` all of it counts as reading."""
        end = time.perf_counter()
        read = self._read if self._read is not None else end
        return BatchStages(read - self._start, end - read)
