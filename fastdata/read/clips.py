"""Clips in the epoch plan: a clip is a sample, named by (video, clip number).

A video split of V videos read with `ClipSampling(clips=N)` is, for the plan
(`fastdata.read.plan`), a split of V * N samples: row r is clip ``r % N`` of video row
``r // N`` (each shard's size times N, `ClipSpec.shard_sizes`). Everything the plan does for
images it therefore does for clips, unchanged: the epoch order and shuffles, equal batches on
every rank with the one padding rule, per-sample seeds, and a resume that counts global clips
(exact, and elastic across world sizes). A mix of video datasets (`fastdata.read.mix`) is read
the same way once its datasets are counted in clips (`clip_mix`): dataset i of V_i videos holds
V_i * N samples, so the weights share out clips and each epoch draws exact clip counts.

Where a clip starts (`clip_frames`):

- training with ``mode="random"``: anywhere in the video, drawn from the clip's per-sample seed
  (`fastdata.read.plan.sample_seed` of its position in the epoch), so a clip's frames depend on
  the epoch and its place in the order, never on the rank or worker decoding it;
- ``mode="uniform"``, and every evaluation: clip j of N starts at the j-th of N evenly spaced
  starts from the first to the last possible one, so evaluation reads every video's N clips
  exactly once, the same every time.

A clip is T frames `stride` frames apart, or, with `fps`, the frames shown at T instants
``1 / fps`` seconds apart (variable frame rate videos included, by the index's timestamps). A
video shorter than a clip repeats its last frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from fastdata.format.manifest import Manifest
from fastdata.format.video import ClipIndex
from fastdata.read.base import LoaderSpec
from fastdata.read.mix import MIX_KIND

__all__ = ["ClipSampling", "ClipSpec", "clip_frames", "clip_mix"]


@dataclass(frozen=True)
class ClipSampling:
    """Which clips an epoch reads of each video.

    Args:
        frames: frames per clip (T).
        stride: frames between two frames of a clip (ignored with `fps`).
        fps: take the frames shown at this rate instead of every `stride`-th frame; None: stride.
        clips: clips per video per epoch (N).
        mode: "random" (training clips start anywhere, drawn from the plan's seeds) or
            "uniform" (N evenly spaced clips; evaluation always reads these).

    Raises:
        ValueError: a count below 1, a non-positive fps, or an unknown mode.
    """

    frames: int = 8
    stride: int = 1
    fps: float | None = None
    clips: int = 1
    mode: Literal["random", "uniform"] = "random"

    def __post_init__(self) -> None:
        for name in ("frames", "stride", "clips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClipSampling.{name} must be an integer >= 1, got {value!r}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"ClipSampling.fps must be > 0 or None, got {self.fps!r}")
        if self.mode not in ("random", "uniform"):
            raise ValueError(f"ClipSampling.mode must be 'random' or 'uniform', got {self.mode!r}")


def clip_frames(
    index: ClipIndex,
    sampling: ClipSampling,
    clip: int,
    rng: np.random.Generator | None,
) -> np.ndarray:
    """The frame numbers (int64, (T,)) of clip `clip` of a video.

    Args:
        index: the video's clip index.
        sampling: the clip settings.
        clip: which of the video's N clips (0 <= clip < N).
        rng: the clip's generator for a random start; None: the uniform start of `clip`.
    """
    count, t = sampling.clips, sampling.frames
    if sampling.fps is None:
        span = (t - 1) * sampling.stride
        last_start = max(0, index.frames - 1 - span)
        start = _start(last_start, clip, count, rng, integer=True)
        frames = int(start) + np.arange(t, dtype=np.int64) * sampling.stride
    else:
        times = index.seconds()
        last_start = max(0.0, float(times[-1]) - (t - 1) / sampling.fps)
        start = _start(last_start, clip, count, rng, integer=False)
        wanted = start + np.arange(t, dtype=np.float64) / sampling.fps
        # The frame on screen at each instant: the last that starts at or before it.
        frames = np.searchsorted(times, wanted + 1e-9, side="right").astype(np.int64) - 1
    return np.clip(frames, 0, index.frames - 1)


def _start(
    last: float, clip: int, count: int, rng: np.random.Generator | None, integer: bool
) -> float:
    """A clip's start in [0, last]: drawn (rng), else the clip's evenly spaced one."""
    if rng is not None:
        return float(rng.integers(0, int(last) + 1)) if integer else float(rng.uniform(0, last))
    where = last * clip / (count - 1) if count > 1 else last / 2
    return float(round(where)) if integer else where


@dataclass(frozen=True)
class ClipSpec(LoaderSpec):
    """A `LoaderSpec` of a video split read as clips (`ClipSampling`): its plan's samples are
    clips (the module docstring), so `shard_sizes` is each shard's videos times `clips.clips`.

    Args:
        clips: the clip settings (every other argument is `LoaderSpec`'s).
    """

    clips: ClipSampling = ClipSampling()

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Clips per shard of the split (videos times clips per video), in manifest order."""
        return tuple(n * self.clips.clips for n in self.video_sizes)

    @property
    def video_sizes(self) -> tuple[int, ...]:
        """Videos per shard of the split, in manifest order."""
        return tuple(s.num_samples for s in self.manifest.split(self.split).shards)

    def random_starts(self) -> bool:
        """Whether clips start at random (training with mode "random") or uniformly."""
        return self.train and self.clips.mode == "random"


def clip_mix(manifest: Manifest, sampling: ClipSampling) -> Manifest:
    """A mix of video datasets (`fastdata.read.mix.mix_manifests`) counted in clips: each
    dataset's samples per split times `sampling.clips`, so the mix's epoch size, weights' shares,
    exact per-epoch (or, scheduled, per-batch) counts and resume fingerprint are all in clips,
    the plan's samples. A given ``epoch_samples`` counts clips already. Anything but a mix is
    returned unchanged (its shards, counted in videos, are read by `ClipSpec.shard_sizes`)."""
    if manifest.source.get("kind") != MIX_KIND:
        return manifest
    n = sampling.clips
    datasets = [
        {**d, "samples": {split: count * n for split, count in d["samples"].items()}}
        for d in manifest.source["datasets"]
    ]
    return replace(manifest, source={**manifest.source, "datasets": datasets, "clips": n})
