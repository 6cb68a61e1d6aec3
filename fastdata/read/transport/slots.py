"""Batches handed from loader workers to the training process through reused shared memory.

torch's DataLoader sends a tensor from a worker by moving its storage to a new shared-memory
file, passing the file descriptor over a socket and mapping it in the training process, once per
tensor and batch. For small images that hand-over costs more than making the batch: for a
256 x 3 x 32 x 32 uint8 batch plus its labels, ~1.4 ms of the worker's CPU and ~0.8 ms of the
training process's (measured with workers yielding ready-made batches; 0.3 and 0.3 ms through
`BatchSlots`, the training process's copy out included).

`BatchSlots` is made in the training process before the workers start: per worker, `depth`
slots of shared memory, each the size of one batch's images and labels. A worker writes a batch
into its next slot when that slot is free (or decodes it there: `target`) and sends a small
`SlotRef`; the training process copies
the batch out (into memory it owns: pinned, or reused buffers) and frees the slot. A busy slot,
a batch of another shape or an unshared mapping make the worker send the tensors as before.
Every write carries a fresh random token, written last into the slot's state and compared by the
training process before and after its copy: a batch overwritten or never written (a bug, not a
case of use) raises instead of being trained on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdata._util.pool import TensorPool

__all__ = ["MAX_SLOT_BYTES", "BatchSlots", "SlotError", "SlotRef"]

log = logging.getLogger("fastdata")

#: Most shared memory the slots of one loader may take (all workers), and at most a quarter of
#: what /dev/shm has free (a container's defaults to 64 MiB). Where `depth` slots per worker do
#: not fit, fewer do (at least `MIN_DEPTH`; a batch that finds its slot busy is sent the usual
#: way); where not even those fit, every batch is. 2 workers x 6 slots of 64 x 3 x 224 x 224
#: photos take 110 MiB; through them, ~0.1 ms less CPU an image in all processes than as tensors
#: (a new shared-memory file each batch, mapped anew by the training process). The quarter is of
#: what is free when a loader is made: loaders made at once (train and val, DDP ranks on one
#: machine) each count the same free memory.
MAX_SLOT_BYTES = 256 * 2**20
MIN_DEPTH = 2

_BUSY, _TOKEN = 0, 1  # columns of the state tensor


class SlotError(RuntimeError):
    """A slot does not hold the batch its reference names (never expected: a bug)."""


@dataclass(frozen=True)
class SlotRef:
    """A batch a worker wrote into one of its slots: (n, C, H, W) uint8 images, n int64 labels."""

    worker: int
    slot: int
    token: int
    shape: tuple[int, int, int, int]


class BatchSlots:
    """Per worker, `depth` reusable shared-memory slots of one batch each (see the module doc).

    Args:
        workers: worker processes (each writes only its own slots).
        depth: slots per worker: at least the batches a worker may have in flight
            (prefetch_factor) plus one being copied out; more only waste memory.
        max_batch: most images a batch holds.
        image_shape: (C, H, W) of every image.

    Raises:
        RuntimeError: shared memory cannot be had (see `create`, which returns None instead).
    """

    def __init__(
        self, workers: int, depth: int, max_batch: int, image_shape: tuple[int, int, int]
    ) -> None:
        self.image_shape = tuple(int(v) for v in image_shape)
        self.max_batch = max_batch
        self._label_at = -(-max_batch * _prod(self.image_shape) // 8) * 8  # 8-byte aligned
        size = self._label_at + 8 * max_batch
        self.data = torch.empty((workers, depth, size), dtype=torch.uint8).share_memory_()
        self.state = torch.zeros((workers, depth, 2), dtype=torch.int64).share_memory_()
        self._next = [0] * workers  # each process's cursor (a worker uses only its own)
        self._arrays: tuple[int, np.ndarray, np.ndarray] | None = None  # see `_views`
        # Copies out are made by numpy: one thread. torch's intra-op threads wait on each other
        # whenever another process is busy (a 786 KB copy_ took 13 ms on 2 loaded cores).
        self._pool = TensorPool()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = None  # numpy views pickle by value: made again where unpickled
        state["_pool"] = TensorPool()  # the training process's buffers stay there
        return state

    def _views(self) -> tuple[np.ndarray, np.ndarray]:
        """numpy views of `data` and `state` in this process (element reads cost ~0.1 us)."""
        if self._arrays is None or self._arrays[0] != os.getpid():
            self._arrays = (os.getpid(), self.data.numpy(), self.state.numpy())
        return self._arrays[1], self._arrays[2]

    @classmethod
    def create(
        cls, workers: int, depth: int, max_batch: int, image_shape: tuple[int, int, int]
    ) -> BatchSlots | None:
        """The slots: `depth` per worker, or as many as fit in `MAX_SLOT_BYTES` and a quarter of
        the free shared memory; None when fewer than `MIN_DEPTH` fit or shared memory cannot be
        had (batches then travel as tensors)."""
        if workers < 1 or depth < 1 or max_batch < 1:
            return None
        per_slot = max_batch * (_prod(image_shape) + 8) + 8
        fits = min(MAX_SLOT_BYTES, _shm_free() // 4) // (workers * per_slot)
        if fits < min(MIN_DEPTH, depth):
            return None
        depth = min(depth, fits)
        try:
            return cls(workers, depth, max_batch, image_shape)
        except RuntimeError as exc:  # no /dev/shm, or it is full
            log.debug("batch slots unavailable (%s); batches are sent as tensors", exc)
            return None

    @property
    def nbytes(self) -> int:
        """Shared memory the slots take."""
        return self.data.numel() + 8 * self.state.numel()

    def target(self, worker: int, n: int) -> np.ndarray | None:
        """(In worker `worker`) the images part of its next slot as an (n, C, H, W) uint8 array
        to decode a batch into, when that slot is free: `put` then copies nothing but labels.

        The slot stays free (and its token cleared) until `put`: a batch decoded here and then
        not put (an error, a skipped sample) leaves nothing a reference could match. Only the
        thread that puts may ask (the next slot is the one `put` writes).
        """
        if not 0 < n <= self.max_batch or not self.data.is_shared():
            return None
        slot = self._next[worker]
        data, states = self._views()
        if states[worker, slot, _BUSY] != 0:
            return None
        states[worker, slot, _TOKEN] = 0
        return data[worker, slot][: n * _prod(self.image_shape)].reshape(n, *self.image_shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in the slots (a batch decoded into a `target`)."""
        start = self.data.data_ptr()
        return start <= tensor.data_ptr() < start + self.data.numel()

    def put(self, worker: int, images: torch.Tensor, labels: torch.Tensor) -> SlotRef | None:
        """(In worker `worker`) copy a batch into its next slot; None when the slot is still
        held, the batch does not fit, or the slots are not shared with the training process.
        Images decoded into the slot's `target` are not copied."""
        n = images.shape[0]
        if (
            not 0 < n <= self.max_batch
            or tuple(images.shape[1:]) != self.image_shape
            or images.dtype != torch.uint8
            or labels.shape != (n,)
            or not self.data.is_shared()
        ):
            return None
        slot = self._next[worker]
        data, states = self._views()
        state = states[worker, slot]
        if state[_BUSY] != 0:
            return None
        token = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        state[_TOKEN] = 0  # writing: no reference matches until the batch is whole
        row = data[worker, slot]
        if images.data_ptr() != row.ctypes.data or not images.is_contiguous():  # else `target`
            np.copyto(row[: images.numel()].reshape(images.shape), images.numpy())
        row[self._label_at : self._label_at + 8 * n].view(np.int64)[:] = labels.numpy()
        state[_TOKEN] = token
        state[_BUSY] = 1
        self._next[worker] = (slot + 1) % states.shape[1]
        return SlotRef(worker, slot, token, (n, *self.image_shape))

    def take(self, ref: SlotRef, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(In the training process) the batch `ref` names, copied out; its slot is then free.

        Args:
            ref: what the worker sent.
            pin: copy the images into page-locked memory (torch's caching host allocator, which
                keeps a buffer from reuse while a non-blocking copy from it runs); else into a
                reused buffer nothing else holds (`TensorPool`).

        Raises:
            SlotError: the slot does not hold that batch.
        """
        data, states = self._views()
        state = states[ref.worker, ref.slot]
        self._check(state, ref)
        n = ref.shape[0]
        row = data[ref.worker, ref.slot]
        if pin:
            images = torch.empty(ref.shape, dtype=torch.uint8, pin_memory=True)
        else:
            images = self._pool.empty(ref.shape, torch.uint8, torch.device("cpu"))
        np.copyto(images.numpy(), row[: images.numel()].reshape(ref.shape))
        labels = torch.from_numpy(
            row[self._label_at : self._label_at + 8 * n].view(np.int64).copy()
        )
        self._check(state, ref)  # not rewritten while it was copied
        state[_BUSY] = 0
        return images, labels

    def release(self, worker: int) -> None:
        """(In worker `worker`, as an iteration starts) free its slots and start at the first.

        Batches of an earlier iteration still in flight when the training process started this
        one are dropped by the DataLoader unread, so their slots were never freed. A worker
        starts an iteration only after finishing every task of the last one, and the training
        process takes no batch of that iteration once it has started this one.
        """
        self._views()[1][worker, :, _BUSY] = 0
        self._next[worker] = 0

    @staticmethod
    def _check(state: np.ndarray, ref: SlotRef) -> None:
        if state[_TOKEN] != ref.token or state[_BUSY] != 1:
            raise SlotError(
                f"batch slot {ref.slot} of loader worker {ref.worker} does not hold the batch "
                "the worker sent (overwritten or not shared); this is a fastdata bug: please "
                "report it with the loader's settings (num_workers=0 avoids the slots)"
            )


def _shm_free() -> int:
    """Bytes free in /dev/shm (where torch's shared memory lives on Linux); unbounded elsewhere."""
    try:
        stat = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return MAX_SLOT_BYTES * 4
    return stat.f_bavail * stat.f_frsize


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for v in shape:
        out *= int(v)
    return out
