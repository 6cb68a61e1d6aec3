"""`DaliVideoLoader`: clips decoded by DALI's video decoder, on NVDEC where a GPU is used.

The video backend of ``VideoDataModule(backend="dali")``: the batches of the cpu video loader
(`fastdata.read.backends.video`: the same plan, clips, frames, order, padding and resume), with
the decoding and the resize done by one DALI pipeline for the loader's life (`PipelineLoader`).

For each planned clip (`fastdata.read.backends.video.planned_clips`: the video's bytes and the
frame numbers of `fastdata.read.clips.clip_frames`, from the same seeds) the pipeline's
``fn.decoders.video`` decodes those frames only (``frames=``: it seeks to the key frame before
them), on NVDEC (``device="mixed"``) with a CUDA training device, else with DALI's FFmpeg CPU
operators; ``fn.resize`` brings the window of each frame that `decode_clip` keeps
(`fastdata.read.decoders.video.source_window`) to ``S x S`` and the loader turns each clip by
its rotation on the device. Out come uint8 ``(B, T, 3, S, S)`` clips and int64 labels on the
device DALI ran on (with ``keys=True`` the cpu loader's keys dict).

Pixels: the cpu loader's scale is FFmpeg's swscale area filter, DALI's an antialiased linear
one, so the frames agree up to that filter (tests/video/test_dali_video.py: within 3 grey
levels on average on sharp synthetic frames, more at hard edges); the decoded frames themselves
agree within 2 grey levels.

CPU fallback: a codec the DALI backend in use cannot decode (`DALI_CODECS`: H.264, HEVC, AV1 and
MPEG-4 on the CPU operators; any other codec anywhere) is decided up front from the clip index's
``codec``: such clips are decoded by `decode_clip` (PyAV) while the batch is fed, put in their
batch slots, and counted (`DaliVideoLoader.cpu_fallbacks`). A batch of fallback clips only does
not run the pipeline (DALI refuses empty batches).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastdata.read.backends.dali.loader import PipelineLoader
from fastdata.read.backends.dali.pipeline import new_pipeline
from fastdata.read.backends.video import PlannedClip, check_clip_spec, clip_batch, planned_clips
from fastdata.read.clips import ClipSpec
from fastdata.read.decoders.video import decode_clip, source_window
from fastdata.read.plan import EpochPlan
from fastdata.read.rows import RowReader, Skip
from fastdata.read.shardio import ShardReader

__all__ = ["DALI_CODECS", "DaliVideoLoader", "make_dali_video_loader"]

log = logging.getLogger("fastdata")

_CPU_CODECS = frozenset({"vp8", "vp9", "mjpeg"})
#: Codecs (clip index ``codec``, FFmpeg's names) that DALI's video decoder takes, per backend
#: (DALI 2.4's documentation of ``fn.decoders.video``); other clips go to the CPU fallback.
DALI_CODECS: dict[str, frozenset[str]] = {
    "cpu": _CPU_CODECS,
    "mixed": _CPU_CODECS | {"h264", "hevc", "av1", "mpeg4"},
}


@dataclass
class ClipBatch:
    """One planned batch as fed: the DALI inputs of the clips DALI decodes, and the rest.

    Attributes:
        clips: the batch's clips in slot order.
        dali: slots (indices into `clips`) that DALI decodes, in the order it is fed them.
        fallback: slot -> the clip decoded on the CPU (uint8 (T, 3, S, S)).
        inputs: the pipeline's inputs (data, frames, roi_start, roi_end); None once fed.
    """

    clips: list[PlannedClip]
    dali: list[int] = field(default_factory=list)
    fallback: dict[int, np.ndarray] = field(default_factory=dict)
    inputs: tuple[list[np.ndarray], ...] | None = None

    def take(self) -> tuple[list[np.ndarray], ...]:
        """The pipeline inputs, handed over once (then dropped: they view the shards)."""
        inputs, self.inputs = self.inputs, None
        assert inputs is not None
        return inputs


class DaliVideoLoader(PipelineLoader):
    """Clip batches of one split on one rank, decoded by a DALI pipeline (module docstring).

    Attributes:
        backend: "mixed" (NVDEC, with a CUDA device) or "cpu" (DALI's CPU operators).
        cpu_fallbacks: clips decoded on the CPU because DALI's `backend` cannot decode their
            codec, over the loader's life (counted as their batches are yielded).
        applied_ops: 0: the crop and flip run on the device (`fastdata.augment.Preset.apply`).

    Args:
        spec: a `ClipSpec` with `image_size` (the side S of the frames).

    Raises:
        ValueError: not a video split, no image_size, or ``on_error="skip"`` /
            ``verify_samples`` (see `PipelineLoader`).
        ImportError: DALI is not installed.
    """

    def __init__(self, spec: ClipSpec) -> None:
        check_clip_spec(spec)
        super().__init__(spec)
        self.spec: ClipSpec = spec
        self.backend = "mixed" if self.gpu else "cpu"
        self.cpu_fallbacks = 0
        self.applied_ops = 0
        self._codecs = DALI_CODECS[self.backend]
        self._warned = False
        self.start_at(spec)

    def _build(self, options: dict[str, Any]) -> Any:
        return build_video_pipeline(
            self._next_inputs, self.backend, int(self.spec.image_size or 0), **options
        )

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple]:
        fed, mine = itertools.tee(self._batches(plan))
        # The pipeline pulls the batches it decodes, ahead (its prefetch); this loop takes every
        # batch in plan order and runs the pipeline for those that have clips for it.
        self._start(b.take() for b in fed if b.dali)
        total = len(plan.rows)
        for number, batch in enumerate(mine):
            outputs = self._run(number, total) if batch.dali else None
            clips = self._assemble(batch, outputs)
            self.cpu_fallbacks += len(batch.fallback)
            yield clip_batch(clips, batch.clips, self.spec.keys)
        self._drain()

    def _batches(self, plan: EpochPlan) -> Iterator[ClipBatch]:
        """Each planned batch's clips, read from the shards; fallback clips decoded here."""
        spec = self.spec
        reader = ShardReader(spec.manifest, spec.split, cache=spec.cache)
        rows = RowReader(reader, spec.shard_sizes, train=spec.train)  # on_error="raise" only
        skips: list[Skip] = []  # stays empty: `rows.fail` raises
        try:
            for number in range(len(plan.rows)):
                clips = list(planned_clips(reader, spec, plan, number, skips, rows.fail))
                yield self._feed_batch(clips, rows)
        finally:
            reader.close()

    def _feed_batch(self, clips: list[PlannedClip], rows: RowReader) -> ClipBatch:
        """A batch's DALI inputs and its fallback clips, decoded (errors name shard and key)."""
        side = int(self.spec.image_size or 0)
        batch = ClipBatch(clips)
        data, frames, starts, ends = [], [], [], []
        for i, clip in enumerate(clips):
            if clip.index.codec in self._codecs:
                window = source_window(clip.index, side)
                batch.dali.append(i)
                data.append(np.frombuffer(clip.video, dtype=np.uint8))
                frames.append(clip.frames.astype(np.int32))
                starts.append(np.array(window[:2], np.float32))
                ends.append(np.array(window[2:], np.float32))
                continue
            self._warn(clip, rows)
            try:
                batch.fallback[i] = decode_clip(clip.video, clip.index, clip.frames, side)
            except (ValueError, OSError) as exc:
                rows.fail(clip.shard, clip.sample, exc)  # raises (on_error="raise")
        if batch.dali:
            batch.inputs = (data, frames, starts, ends)
        return batch

    def _warn(self, clip: PlannedClip, rows: RowReader) -> None:
        """Log the first fallback of the loader's life, naming the video."""
        if self._warned:
            return
        self._warned = True
        shard, key = rows.reader.shards[clip.shard].name, rows.reader.key(clip.shard, clip.sample)
        log.warning(
            "dali video loader (%s): %s of shard %s is %s, which DALI's %s decoder does not take; "
            "such clips are decoded on the CPU (PyAV) and counted in the loader's cpu_fallbacks",
            self.spec.split, key, shard, clip.index.codec, self.backend,
        )  # fmt: skip

    def _assemble(self, batch: ClipBatch, outputs: Any) -> torch.Tensor:
        """The batch's uint8 (B, T, 3, S, S) clips on the device: DALI's, turned by each clip's
        rotation, and the fallback clips, each in its slot."""
        side, t = int(self.spec.image_size or 0), self.spec.clips.frames
        out = torch.empty((len(batch.clips), t, 3, side, side), dtype=torch.uint8)
        out = out.to(self._device())
        if outputs is not None:
            decoded = self._torch(outputs[0], torch.uint8)  # (n, T, 3, S, S), unturned
            turns = torch.tensor([batch.clips[i].index.rotation // 90 for i in batch.dali])
            for k in turns.unique().tolist():
                chosen = (turns == k).nonzero().flatten().to(decoded.device)
                turned = torch.rot90(decoded[chosen], k, dims=(-2, -1))  # as np.rot90: CCW
                out[torch.tensor(batch.dali)[turns == k].to(out.device)] = turned
        for i, pixels in batch.fallback.items():
            out[i] = torch.from_numpy(pixels).to(out.device)
        return out


def build_video_pipeline(source: Any, backend: str, side: int, **options: Any) -> Any:
    """A built pipeline whose external source yields (encoded videos, frame numbers, window
    starts, window ends) per batch: decoded by ``fn.decoders.video`` on `backend`, each frame's
    window resized to ``side x side``, out as uint8 (T, 3, side, side) per clip; `options` are
    `new_pipeline`'s."""
    from nvidia.dali import fn, types

    pipe = new_pipeline(**options)
    device = "gpu" if backend == "mixed" else "cpu"
    with pipe:
        data, frames, start, end = fn.external_source(
            source=source,
            num_outputs=4,
            batch=True,
            dtype=[types.UINT8, types.INT32, types.FLOAT, types.FLOAT],
        )
        video = fn.decoders.video(data, device=backend, frames=frames)  # (T, H, W, 3)
        # The linear antialiased filter: the closest of DALI's to swscale's area filter over
        # down- and upscales alike (cubic is closer on some downscales, far off on upscales).
        square = fn.resize(
            video,
            device=device,
            size=[side, side],
            roi_start=start,
            roi_end=end,
            interp_type=types.INTERP_LINEAR,
            antialias=True,
        )
        pipe.set_outputs(fn.transpose(square, device=device, perm=[0, 3, 1, 2]))
    pipe.build()
    return pipe


def make_dali_video_loader(spec: ClipSpec) -> DaliVideoLoader:
    """The DALI video loader of `spec.split` on `spec.rank` (see the module docstring)."""
    return DaliVideoLoader(spec)
