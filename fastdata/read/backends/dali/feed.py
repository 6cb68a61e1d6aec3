"""The DALI pipeline's inputs: each planned batch's samples with the crop windows the cpu backend
draws for them, as per-batch arrays.

For every batch of the epoch plan the feeder reads the samples from the shards (zero-copy views
of the memory-mapped shards: DALI copies them when they are fed) and builds dense arrays: int64
labels (`PAD_LABEL` for evaluation padding); for a crop geometry each image's window and flip,
drawn by `fastdata.read.decoders.image.draw_crop` from the image's size (read from its header)
and the sample's generator (`fastdata.read.plan.sample_seed` of its position in the epoch), the
draws the cpu backend makes for that sample; for "cover", the window of `resize.cover_box`. A raw
split's batch is gathered as one NCHW array (`raw_shard.gather_raw_batch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fastdata.read.backends.dali.pipeline import GraphShape
from fastdata.read.base import LoaderSpec
from fastdata.read.decoders.image import decode_raw, draw_crop
from fastdata.read.decoders.jpeg_header import jpeg_size
from fastdata.read.decoders.resize import cover_box
from fastdata.read.plan import PAD_LABEL, EpochPlan, rows_to_refs, sample_seed
from fastdata.read.raw_shard import gather_raw_batch
from fastdata.read.rows import PlannedBatch, RowReader
from fastdata.read.shardio import ShardReader
from fastdata.write.images import header_size

__all__ = ["PlanFeeder", "weight_inside"]


class PlanFeeder:
    """Yields the DALI inputs (`GraphShape.inputs`) of each batch of a plan, in plan order.

    Args:
        spec: the loader spec.
        shape: the graph the inputs are for.
    """

    def __init__(self, spec: LoaderSpec, shape: GraphShape) -> None:
        self.spec, self.shape = spec, shape
        info = spec.manifest.split(spec.split)
        self._raw = tuple(int(v) for v in info.raw_shape) if shape.raw else None

    def batches(self, plan: EpochPlan) -> Iterator[tuple[Any, ...]]:
        """The inputs of every batch of `plan`; the shards are open while it runs."""
        spec = self.spec
        reader = ShardReader(spec.manifest, spec.split, cache=spec.cache)
        rows = RowReader(reader, spec.shard_sizes, train=spec.train)  # on_error="raise" only
        try:
            for number in range(len(plan.rows)):
                if self._raw is not None:
                    yield self._raw_batch(reader, rows, plan, number)
                else:
                    yield self._encoded_batch(rows, plan, rows.read(plan, number))
        finally:
            reader.close()

    def _raw_batch(
        self, reader: ShardReader, rows: RowReader, plan: EpochPlan, number: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(NCHW uint8 pixels, int64 labels) of a raw batch, gathered by array operations."""
        assert self._raw is not None
        refs = rows_to_refs(plan.rows[number], self.spec.shard_sizes)
        gathered = gather_raw_batch(reader, refs, self._raw)
        if gathered is not None:
            images, labels = gathered
            if not self.spec.train:
                labels[np.asarray(plan.padding[number], dtype=bool)] = PAD_LABEL
            return images, labels
        read = rows.read(plan, number)  # a sample the gather cannot take: named if it is bad
        images = np.empty((len(read.labels), 3, *self._raw[:2]), dtype=np.uint8)
        for i, (slot, (_, data)) in enumerate(zip(read.slots, read.images, strict=True)):
            try:
                images[i] = decode_raw(data, self._raw).transpose(2, 0, 1)
            except ValueError as exc:
                rows.fail(*read.refs[slot], exc)  # raises (on_error="raise")
        return images, np.asarray(read.labels, dtype=np.int64)

    def _encoded_batch(self, rows: RowReader, plan: EpochPlan, read: PlannedBatch) -> tuple:
        """(bytes, labels[, windows]) of an encoded batch (`GraphShape.inputs`)."""
        data = [np.frombuffer(image, dtype=np.uint8) for _, image in read.images]
        labels = np.asarray(read.labels, dtype=np.int64)
        geometry = self.shape.geometry
        if geometry.kind == "none":
            return data, labels
        n = len(data)
        windows = np.empty((n, 4), np.float64)  # the decoded window: (left, top, right, bottom)
        boxes = np.empty((n, 4), np.float64)  # what is resized, in the window's pixels
        mirror = np.zeros(n, np.int32)
        positions = plan.positions[read.number]
        for i, slot in enumerate(read.slots):
            size = self._size(rows, read, i)
            if geometry.kind == "cover":  # the whole image; the box as the Pillow path's
                windows[i] = (0, 0, *size)
                boxes[i] = cover_box(size, size, geometry.hw)
                continue
            rng = np.random.default_rng(
                sample_seed(self.spec.seed, plan.epoch, int(positions[slot]))
            )
            box, mirror[i] = draw_crop(size, geometry, rng)
            windows[i] = box
            boxes[i] = (0, 0, box[2] - box[0], box[3] - box[1])  # crop, then resize
        return (data, labels, *_window_inputs(windows, boxes, geometry.out_hw), mirror)

    @staticmethod
    def _size(rows: RowReader, read: PlannedBatch, i: int) -> tuple[int, int]:
        """(width, height) of image i of the batch from its header; ShardReadError naming the
        shard and key when it cannot be read."""
        data = read.images[i][1]
        hw = jpeg_size(data)
        if hw is not None:
            return hw[1], hw[0]
        try:
            size = header_size(bytes(data))
        except ValueError as exc:  # UnreadableImage: a decompression bomb
            rows.fail(*read.refs[read.slots[i]], exc)
            raise  # not reached: on_error="raise" raises above
        if size is None:
            rows.fail(*read.refs[read.slots[i]], ValueError("unreadable image header"))
        assert size is not None
        return size


def _window_inputs(
    windows: np.ndarray, boxes: np.ndarray, hw: tuple[int, int]
) -> tuple[np.ndarray, ...]:
    """(anchor, shape, pad_h, pad_w, roi_start, roi_end, rows, cols) of
    `pipeline.WINDOW_INPUTS`.

    The window is padded on every side by the resize filter's reach (the triangle's radius,
    the downscale factor, at least one pixel, plus one), so the ROI moves by that padding.
    """
    size = windows[:, 2:] - windows[:, :2]  # (w, h)
    extent = boxes[:, 2:] - boxes[:, :2]
    reach = np.ceil(np.maximum(np.max(extent / [hw[1], hw[0]], axis=1), 1.0)) + 1
    pad = reach[:, None]
    rows = np.stack(
        [
            weight_inside(h, lo, hi, hw[0])
            for h, lo, hi in zip(size[:, 1], boxes[:, 1], boxes[:, 3], strict=True)
        ]
    )
    cols = np.stack(
        [
            weight_inside(w, lo, hi, hw[1])
            for w, lo, hi in zip(size[:, 0], boxes[:, 0], boxes[:, 2], strict=True)
        ]
    )
    arrays = (
        (windows[:, :2], np.int32),
        (size, np.int32),
        (size[:, 1] + 2 * reach, np.float32),
        (size[:, 0] + 2 * reach, np.float32),
        (boxes[:, [1, 0]] + pad, np.float32),
        (boxes[:, [3, 2]] + pad, np.float32),
        (rows[:, :, None, None], np.float32),
        (cols[:, None, :, None], np.float32),
    )
    return tuple(np.ascontiguousarray(a, dtype=t) for a, t in arrays)  # DALI takes no strides


def weight_inside(length: float, start: float, end: float, n: int) -> np.ndarray:
    """Per output pixel of a 1-D resize of [start, end) to `n` pixels, the share of its filter's
    weight that falls on the image's `length` pixels (1 inside, less at the edges).

    The filter is the antialiased linear one of Pillow, torch and DALI: a triangle of radius
    ``max(1, scale)`` input pixels around the output pixel's centre, scale = (end - start) / n.
    Pillow renormalizes the weights on the image; DALI's resize of an image padded with zeros
    does not: dividing its output by this share gives Pillow's (`pipeline._resize_like_pillow`).
    """
    scale = (end - start) / n
    radius = max(1.0, scale)
    centre = start + (np.arange(n) + 0.5) * scale
    k = int(np.ceil(radius)) + 1
    pixel = np.floor(centre)[:, None] + np.arange(-k, k + 1)[None, :]
    weight = np.clip(1.0 - np.abs(pixel + 0.5 - centre[:, None]) / radius, 0.0, None)
    inside = (pixel >= 0) & (pixel < length)
    return (weight * inside).sum(axis=1) / weight.sum(axis=1)
