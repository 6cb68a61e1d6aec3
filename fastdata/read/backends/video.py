"""The video backend: the cpu backend's workers, making batches of clips.

`VideoLoader` is a `CpuLoader` (DataLoader workers that die with the training process, bounded
waits, persistent workers that follow `set_epoch` through shared memory, the next epoch's first
batch made ahead) whose workers iterate `ClipBatchDataset`: for each planned clip
(`fastdata.read.clips`: row r is clip ``r % N`` of video ``r // N``) it reads the video's
components from the shard (in place, memory-mapped), picks the clip's frames from the clip index
and the clip's seed, and decodes only those (`fastdata.read.decoders.video.decode_clip`).

Batches: uint8 ``(B, T, 3, S, S)`` clips and int64 labels (evaluation padding: -100); with
``keys=True`` a third element ``{"key": [...], "start": [...]}``: each clip's video key and
first frame number (None for padding), so predictions can be gathered per video (a
DataModule adds ``source_id``: the video's path in the source). The crop and flip run on the device, the same for every
frame of a clip (`fastdata.augment.Preset.apply`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fastdata.format import schema
from fastdata.format.video import ClipIndex
from fastdata.read.backends.cpu import CpuLoader
from fastdata.read.backends.cpu_batches import ShardBatchDataset
from fastdata.read.clips import ClipSpec, clip_frames
from fastdata.read.decoders.video import decode_clip, video_parts
from fastdata.read.plan import PAD_LABEL, EpochPlan, rows_to_refs, sample_seed
from fastdata.read.rows import Skip
from fastdata.read.shardio import ShardReader
from fastdata.read.transport.stage_times import StageClock

__all__ = [
    "ClipBatchDataset",
    "PlannedClip",
    "VideoLoader",
    "check_clip_spec",
    "clip_batch",
    "make_video_loader",
    "planned_clips",
]


class ClipBatchDataset(ShardBatchDataset):
    """`ShardBatchDataset` whose batches are clips (see the module docstring).

    Args:
        spec: a `ClipSpec` whose `image_size` is the side S of the decoded frames.

    Raises:
        ValueError: not a `ClipSpec`, no image_size, or a split that holds no videos.
    """

    def __init__(self, spec: ClipSpec) -> None:
        check_clip_spec(spec)
        super().__init__(spec)
        self.spec: ClipSpec = spec
        self.applied_ops = 0

    def image_shape(self) -> None:
        """None: clip batches travel as tensors, not through the image slots."""
        return None

    def _load_batch(
        self, reader: ShardReader, plan: EpochPlan, number: int, skips: list[Skip]
    ) -> tuple:
        """Batch `number` of `plan`: (clips, labels) or, with keys, (clips, labels, keys)."""
        spec = self.spec
        side, t = int(spec.image_size or 0), spec.clips.frames
        out = np.empty((len(plan.rows[number]), t, 3, side, side), np.uint8)
        kept: list[PlannedClip] = []
        clock = StageClock()  # read: the samples and clip indexes; decode: the clips' frames
        planned = list(planned_clips(reader, spec, plan, number, skips, self._rows(reader).fail))
        clock.read_done()
        for clip in planned:
            try:
                decode_clip(clip.video, clip.index, clip.frames, side, out=out[clip.slot])
            except (ValueError, OSError) as exc:  # decoding
                skips.append(self._fail(reader, clip.shard, clip.sample, exc))
                continue
            kept.append(clip)
        # What a batch costs to make, for the loop-following worker sizing (`LoaderMonitor`).
        self.stage_times.record(plan.epoch, number, *clock.stages())
        slots = [c.slot for c in kept]
        clips_out = torch.from_numpy(out if len(kept) == len(out) else out[slots])
        return clip_batch(clips_out, kept, spec.keys)


def check_clip_spec(spec: object) -> None:
    """What every video loader needs of its spec: a `ClipSpec` with `image_size`, over a split
    of videos (ValueError naming the split otherwise)."""
    if not isinstance(spec, ClipSpec):
        raise ValueError(f"the video loader needs a ClipSpec, got {type(spec).__name__}")
    info = spec.manifest.split(spec.split)
    if info.encoding != schema.VIDEO_ENCODING:
        raise ValueError(
            f"split {spec.split!r} of {spec.manifest.root} holds {info.encoding!r} samples, "
            "not videos; write it with `fastdata shard video`"
        )
    if spec.image_size is None:
        raise ValueError("the video loader needs image_size (the side of decoded frames)")


@dataclass(frozen=True)
class PlannedClip:
    """One planned clip of a batch, read but not decoded (`planned_clips`).

    Attributes:
        slot: its place in the batch.
        shard: the shard's number in the split.
        sample: the video's index in the shard.
        video: the video file's bytes (a view into the shard).
        index: its clip index.
        frames: the clip's frame numbers (`fastdata.read.clips.clip_frames`).
        label: the video's label (`PAD_LABEL` for evaluation padding).
        key: the video's key (None for evaluation padding).
    """

    slot: int
    shard: int
    sample: int
    video: memoryview
    index: ClipIndex
    frames: np.ndarray
    label: int
    key: str | None


def planned_clips(
    reader: ShardReader,
    spec: ClipSpec,
    plan: EpochPlan,
    number: int,
    skips: list[Skip],
    fail: Callable[[int, int, Exception], Skip],
) -> Iterator[PlannedClip]:
    """The clips of batch `number` of `plan`, in batch order, with the frames each needs: what
    every video backend decodes (row r is clip ``r % N`` of video ``r // N``; a random start
    drawn from the clip's per-sample seed). A clip whose video or index cannot be read is
    `fail`'s (which raises, or returns the `Skip` appended to `skips`)."""
    rows, pads = plan.rows[number], plan.padding[number]
    positions = plan.positions[number]
    videos, clips = np.divmod(rows, spec.clips.clips)
    refs = rows_to_refs(videos, spec.video_sizes).tolist()
    for slot, (shard, index) in enumerate(refs):
        rng = None
        if spec.random_starts():
            rng = np.random.default_rng(sample_seed(spec.seed, plan.epoch, int(positions[slot])))
        try:
            parts = reader.sample(shard, index)
            key = reader.key(shard, index)
            label, _ = schema.label_and_id(key, parts, reader.position(shard, index))
            label = reader.shards[shard].map_label(label)  # a mix's merged classes
            video, clip_index = video_parts(
                parts, (reader.manifest.shard_url(reader.shards[shard]), key)
            )
            frames = clip_frames(clip_index, spec.clips, int(clips[slot]), rng)
        except (ValueError, OSError) as exc:  # ShardReadError, ClipIndexError
            skips.append(fail(shard, index, exc))
            continue
        padding = bool(pads[slot]) and not spec.train
        label, name = (PAD_LABEL, None) if padding else (label, key)
        yield PlannedClip(slot, shard, index, video, clip_index, frames, label, name)


def clip_batch(clips: torch.Tensor, kept: list[PlannedClip], keys: bool) -> tuple:
    """A video batch: (clips, int64 labels) and, with `keys`, ``{"key": [...], "start":
    [...]}`` (each clip's video key and first frame; None for padding); labels on the clips'
    device."""
    labels = torch.tensor([c.label for c in kept], dtype=torch.int64, device=clips.device)
    if not keys:
        return clips, labels
    starts = [None if c.key is None else int(c.frames[0]) for c in kept]
    return clips, labels, {"key": [c.key for c in kept], "start": starts}


class VideoLoader(CpuLoader):
    """The cpu backend's loader over `ClipBatchDataset` (see the module docstring)."""

    dataset_type = ClipBatchDataset


def make_video_loader(spec: ClipSpec) -> VideoLoader:
    """The video loader for one split on one rank."""
    return VideoLoader(spec)
