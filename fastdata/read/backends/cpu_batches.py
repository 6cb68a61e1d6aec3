"""The cpu backend's worker side: one rank's batches of an epoch, made whole in a process.

`ShardBatchDataset` is what each DataLoader worker of `fastdata.read.backends.cpu.CpuLoader`
iterates: it reads the plan's batches (`fastdata.read.rows`), decodes them whole (raw splits by
array gathers, `raw_shard.gather_raw_batch`; photos with the preset's decode-time crop and
flip, `decode_geometry`; dict splits field by field), collates them to one uint8 NCHW tensor
and, with persistent workers, writes it into a reused shared-memory slot
(`fastdata.read.transport.slots`). The epoch and resume position come from a small shared
tensor (`ShardBatchDataset.state`), so persistent workers follow `set_epoch` without restarting;
a persistent training worker decodes the next epoch's first batch ahead
(`fastdata.read.backends.next_epoch`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastdata.augment import RandomResizedCrop
from fastdata.format.schema import VIDEO_ENCODING
from fastdata.read.backends.next_epoch import NextEpochBatch
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders.dict_batch import Sample, SampleSpec, decode_samples, sample_spec
from fastdata.read.decoders.image import Geometry, decode_batch, decode_raw, stored_hw
from fastdata.read.plan import PAD_LABEL, EpochPlan, rows_to_refs, sample_seed, worker_batch_numbers
from fastdata.read.raw_shard import gather_raw_batch
from fastdata.read.rows import PlannedBatch, RowReader, Skip, log_skips
from fastdata.read.shardio import ShardReader
from fastdata.read.transport.slots import BatchSlots
from fastdata.read.transport.stage_times import StageClock, StageTimes

__all__ = ["STATE_SLOTS", "ShardBatchDataset", "decode_geometry"]


_EPOCH, _CONSUMED, _STEPS, _SKIPS = 0, 1, 2, 3  # slots of the shared state tensor
#: The slots of `ShardBatchDataset.state` (epoch, consumed, steps before, then skips per worker).
STATE_SLOTS = (_EPOCH, _CONSUMED, _STEPS, _SKIPS)


def decode_geometry(spec: LoaderSpec) -> tuple[Geometry, int]:
    """(decode-time geometry of the split's encoded images, preset ops it covers).

    The preset's leading random-resized crop (and flip) or centre crop is fused into decoding;
    without one, photos are decoded to the stored size (`fastdata.read.decoders.image.stored_hw`: the centre square at
    ``floor(image_size * 256 / 224)`` when the preset crops on the device, else at `image_size`,
    or the common size), as the memory backend stores them.
    Raw splits: no decode-time geometry (every op runs on the device).
    """
    info = spec.manifest.split(spec.split)
    if info.encoding in ("raw", VIDEO_ENCODING):  # videos: `fastdata.read.backends.video`
        return Geometry("none"), 0
    crop, flip_p, covered = spec.preset.decode_crop(spec.train)
    if crop is not None and spec.image_size is not None:
        if isinstance(crop, RandomResizedCrop):
            geometry = Geometry("rrc", spec.image_size, crop.scale, crop.ratio, flip_p)
        else:
            geometry = Geometry("center", spec.image_size, resize_ratio=crop.ratio)
        return geometry, covered
    hw = stored_hw(info, spec.image_size, margin=spec.preset.resizes(spec.train))
    return Geometry("cover", hw=hw), 0


class ShardBatchDataset(IterableDataset):
    """Yields this rank's batches of one epoch as (uint8 NCHW, int64) tensors (from a worker
    given `slots`: a `SlotRef` to them, which `CpuLoader` turns back into the tensors).

    Args:
        spec: what to load (see LoaderSpec); `spec.workers.num_workers` must match the
            DataLoader's.
    """

    def __init__(self, spec: LoaderSpec) -> None:
        super().__init__()
        self.spec = spec
        info = spec.manifest.split(spec.split)
        self.raw_shape = (
            tuple(info.raw_shape) if info.encoding == "raw" and info.raw_shape else None
        )
        self.geometry, self.applied_ops = decode_geometry(spec)
        # Dict datasets (`samples`): every field decoded, the preset's ops drawn as regions and
        # applied to image, masks and boxes together in the workers; only normalizing is left.
        self.sample_spec: SampleSpec | None = sample_spec(spec)
        self.fields = None if self.sample_spec is None else self.sample_spec.fields
        if self.sample_spec is not None:
            self.applied_ops = len(spec.preset.ops(spec.train))
        # [epoch, consumed, steps_before, skipped samples of worker 0, 1, ...]: shared so that
        # (persistent) workers see a new epoch; one skip counter per worker: no increment lost.
        state = [spec.epoch, spec.consumed, spec.steps_before] + [0] * max(
            1, spec.workers.num_workers
        )
        self.state = torch.tensor(state, dtype=torch.int64).share_memory_()
        self._ahead: NextEpochBatch | None = None  # a worker's next-epoch first batch
        self.stage_times = StageTimes()  # each batch's read and decode seconds, for the trainer
        self.slots: BatchSlots | None = None  # set by CpuLoader before its workers start
        self._local = all("://" not in spec.manifest.shard_url(s) for s in info.shards)
        self._kept: ShardReader | None = None  # a worker's reader, kept between epochs

    def plan(self) -> EpochPlan:
        """The plan of the selected epoch from the selected position."""
        epoch, consumed, steps = (int(v) for v in self.state[:_SKIPS])
        return self.spec.plan(epoch, consumed, steps)

    def __len__(self) -> int:
        """Batches per rank this epoch, counting those taken before a resume."""
        return len(self.plan())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, consumed, steps = (int(v) for v in self.state[:_SKIPS])
        ahead, self._ahead = self._ahead, None
        wait = self.spec.workers.timeout or None
        ready = ahead.take((epoch, consumed, steps), wait) if ahead is not None else None
        plan = self.spec.plan(epoch, consumed, steps)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if self.slots is not None and info is not None:
            self.slots.release(worker)  # an earlier iteration's batches were dropped unread
        reader, keep = self._reader(info)
        self._failed_shards: set[str] = set()  # failed remote shards warned about this epoch
        numbers = worker_batch_numbers(len(plan.rows), 0, worker, workers)
        try:
            if numbers:  # remote shards: downloaded ahead, in this worker's order of reading
                rows = np.concatenate([plan.rows[n] for n in numbers])
                shards = rows_to_refs(rows, self.spec.shard_sizes)[:, 0]
                first = np.sort(np.unique(shards, return_index=True)[1])
                reader.prefetch(shards[first].tolist())
            for number in numbers:
                skips: list[_Skip] = []
                if ready is not None and number == ready[0]:
                    batch, skips = ready[1]
                else:
                    batch = self._load_batch(reader, plan, number, skips)
                self._count(skips)
                if number == numbers[-1] and self._looks_ahead(info):
                    self._ahead = NextEpochBatch.start(
                        self.spec, self._load_batch, epoch + 1, worker
                    )
                slots = self.slots if info is not None and isinstance(batch, tuple) else None
                ref = slots.put(worker, *batch[:2]) if slots is not None else None
                if ref is None and slots is not None and slots.holds(batch[0]):
                    batch = (batch[0].clone(), *batch[1:])  # the slot is not this batch's: copied
                # The keys (`LoaderSpec.keys`) travel beside the slot's reference.
                yield batch if ref is None else (ref, *batch[2:]) if len(batch) > 2 else ref
        finally:
            if not keep:
                reader.close()

    def _reader(self, info: object | None) -> tuple[ShardReader, bool]:
        """(the epoch's shard reader, whether it is kept for the next epoch).

        A worker reading local shards keeps its reader, hence its open shards, for its life:
        opening a shard parses and checks its index (CIFAR-100's 10,000-sample shards: ~30 ms
        each, every epoch, in every worker). A remote dataset's reader is made anew each
        epoch: a shard that failed to download is tried again in the next.
        """
        keep = info is not None and self._local
        if keep and self._kept is not None:
            return self._kept, True
        reader = ShardReader(
            self.spec.manifest,
            self.spec.split,
            cache=self.spec.cache,
            verify_samples=self.spec.verify_samples,
        )
        if keep:
            self._kept = reader
        return reader, keep

    def _looks_ahead(self, info: object | None) -> bool:
        """Whether this process decodes the next epoch's first batch once its last one is made.

        Only persistent training workers: they keep this object (and the batch) to the next
        epoch, and their cores would otherwise idle while the training process finishes the
        epoch and starts the next (measured on clothing-small, 12 batches an epoch: the first
        batch of an epoch came ~180 ms after the last, against ~60 ms between batches).
        """
        w = self.spec.workers
        return info is not None and self.spec.train and w.persistent_workers is not False

    def _load_batch(
        self, reader: ShardReader, plan: EpochPlan, number: int, skips: list[_Skip]
    ) -> tuple[torch.Tensor, ...] | Sample:
        """Batch `number` of `plan`; samples skipped under on_error='skip' are added to `skips`.

        With `LoaderSpec.keys`, a classification batch is (images, labels, keys): the sample
        key of each image (None for padding; `fastdata.read.source_ids`).
        """
        kept: list[int] = []  # classification: the plan slots of the batch's images
        clock = StageClock()
        pair = self._load_pair(reader, plan, number, skips, kept, clock)
        self.stage_times.record(plan.epoch, number, *clock.stages())
        if self.fields is not None:
            return pair
        images, labels = pair
        if not self.spec.keys:
            return images, labels
        refs = rows_to_refs(plan.rows[number], self.spec.shard_sizes).tolist()
        pads = [False] * len(refs) if self.spec.train else plan.padding[number].tolist()
        keys = [None if pads[s] else reader.key(*refs[s]) for s in kept]
        return images, labels, keys

    def _load_pair(
        self,
        reader: ShardReader,
        plan: EpochPlan,
        number: int,
        skips: list[_Skip],
        kept: list[int],
        clock: StageClock,
    ) -> tuple[torch.Tensor, torch.Tensor] | Sample:
        """`_load_batch` without keys; the plan slots of the images it holds go to `kept`, the
        end of reading to `clock` (a raw split's array gather counts as reading)."""
        if self.raw_shape is not None and self.fields is None:
            gathered = self._raw_batch(reader, plan, number)  # array operations
            if gathered is not None:
                kept[:] = range(len(gathered[1]))
                return gathered
        rows = self._rows(reader)
        batch = rows.read(plan, number)
        clock.read_done()
        skips += batch.skips
        if self.fields is not None:  # a dict dataset: every field, decoded in `samples`
            return self._sample_batch(rows, plan, batch, skips)
        if self.raw_shape is not None:
            images: list[np.ndarray] = []
            labels: list[int] = []
            for slot, label, (_, data) in zip(batch.slots, batch.labels, batch.images, strict=True):
                try:
                    images.append(decode_raw(data, self.raw_shape))
                except ValueError as exc:
                    skips.append(rows.fail(*batch.refs[slot], exc))
                    continue
                labels.append(label)  # both or neither: images and labels stay aligned
                kept.append(slot)
            return _collate(images, labels, self._empty_hw())
        images, labels, refs = [], batch.labels, batch.refs
        payloads, where = [data for _, data in batch.images], batch.slots
        if payloads:
            images, labels = self._decode(
                reader, plan, number, refs, payloads, where, labels, skips, kept
            )
        return _collate(images, labels, self._empty_hw())

    def _rows(self, reader: ShardReader) -> RowReader:
        return RowReader(
            reader,
            self.spec.shard_sizes,
            train=self.spec.train,
            on_error=self.spec.on_error,
            classification=self.fields is None,
        )

    def _sample_batch(
        self, rows: RowReader, plan: EpochPlan, batch: PlannedBatch, skips: list[_Skip]
    ) -> Sample:
        """A dict dataset's batch: each field decoded, the regions applied (`samples`)."""
        return decode_samples(
            rows, batch, self.sample_spec, batch_seed=int(plan.seeds[batch.number]), skips=skips
        )

    def _raw_batch(
        self, reader: ShardReader, plan: EpochPlan, number: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Batch `number` of a raw split in array operations (`raw_shard.gather_raw_batch`): the
        same tensors as the per-sample path; None when a sample needs that path."""
        assert self.raw_shape is not None
        refs = rows_to_refs(plan.rows[number], self.spec.shard_sizes)
        gathered = gather_raw_batch(reader, refs, self.raw_shape)
        if gathered is None:
            return None
        images, labels = gathered
        if not self.spec.train:
            labels[np.asarray(plan.padding[number], dtype=bool)] = PAD_LABEL
        return torch.from_numpy(images), torch.from_numpy(labels)

    def _batch_array(self, n: int, hw: tuple[int, int]) -> np.ndarray:
        """Where a batch of n images is decoded: the worker's next batch slot when it is free
        (the worker's main thread only: the slot is the one its next `put` writes), else new."""
        info = get_worker_info()
        if (
            self.slots is not None
            and info is not None
            and threading.current_thread() is threading.main_thread()
        ):
            target = self.slots.target(info.id, n)
            if target is not None and target.shape[1:] == (3, *hw):
                return target
        return np.empty((n, 3, *hw), np.uint8)

    def _decode(self, reader, plan, number, refs, payloads, where, labels, skips, slots):
        positions = plan.positions[number]
        rngs = [
            np.random.default_rng(sample_seed(self.spec.seed, plan.epoch, int(positions[i])))
            for i in where
        ]
        # Decoded into the batch (its planar layout) when the images share one size.
        hw = self.geometry.out_hw
        batch = self._batch_array(len(payloads), hw) if min(hw) > 0 else None
        threads = self.spec.workers.decode_threads
        decoded = decode_batch(payloads, self.geometry, rngs, threads, out=batch)
        images, kept = [], []
        for i, label, result in zip(where, labels, decoded, strict=True):
            if isinstance(result, ValueError):
                skips.append(self._fail(reader, *refs[i], result))
                continue
            images.append(result)
            kept.append(label)
            slots.append(i)
        if batch is not None and len(kept) == len(payloads):
            return batch, kept  # complete: `_collate` has nothing to copy
        return images, kept

    def image_shape(self) -> tuple[int, int, int] | None:
        """(C, H, W) of every image of a batch; None when images may differ (unknown here) or
        batches are dicts (a split beyond classification: no slots)."""
        if self.fields is not None:
            return None
        if self.raw_shape is not None:
            return self.raw_shape[2], self.raw_shape[0], self.raw_shape[1]
        hw = self.geometry.out_hw if self.geometry.kind != "none" else None
        return (3, int(hw[0]), int(hw[1])) if hw and all(hw) else None

    def _empty_hw(self) -> tuple[int, int]:
        if self.raw_shape is not None:
            return self.raw_shape[0], self.raw_shape[1]
        return self.geometry.out_hw

    def _fail(self, reader: ShardReader, shard: int, index: int, exc: Exception) -> _Skip:
        """The sample's error (naming shard and key): raised, or returned under on_error='skip'."""
        return self._rows(reader).fail(shard, index, exc)

    def _count(self, skips: list[_Skip]) -> None:
        """Count and log the skipped samples of a batch as it is handed out."""
        if not skips:
            return
        info = get_worker_info()
        self.state[_SKIPS + (info.id if info else 0)] += len(skips)
        # Failed shards: warned once an epoch (`__iter__` resets them); bad samples: once a key
        # in this process (a worker that persists between epochs, or the training process).
        logged = self.__dict__.setdefault("_logged_keys", set())
        log_skips(skips, self.__dict__.setdefault("_failed_shards", set()), logged)


_Skip = Skip


def _collate(
    images: list[np.ndarray] | np.ndarray, labels: list[int], empty_hw: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(images, np.ndarray):  # an NCHW batch, decoded in place (`decode_batch`'s out)
        return torch.from_numpy(images), torch.tensor(labels, dtype=torch.int64)
    if not images:
        return torch.zeros((0, 3, *empty_hw), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64)
    # Transposed to contiguous NCHW here, in the worker: the training process's normalize then
    # reads contiguous bytes (a CL -> NCHW float conversion of a 64 x 224 px batch cost it
    # 13 ms there; the per-image transposes cost 3.4 ms more here than a plain stack).
    batch = np.empty((len(images), images[0].shape[2], *images[0].shape[:2]), dtype=np.uint8)
    for i, image in enumerate(images):
        batch[i] = image.transpose(2, 0, 1)
    return torch.from_numpy(batch), torch.tensor(labels, dtype=torch.int64)
