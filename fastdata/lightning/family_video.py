"""`VideoDataModule`: video clips as samples, over `ShardDataModule`'s plan, resume and hooks.

A split written by ``fastdata shard video`` holds videos; this module reads it as clips
(`fastdata.read.clips`): each epoch takes ``clips.clips`` clips of every video, a clip being a
sample of the one epoch plan, so ranks get equal batches, evaluation reads every (video, clip)
once with its padding marked, and `state_dict` / `load_state_dict` resume mid-epoch exactly,
on another world size too. Batches are uint8 ``(B, T, 3, S, S)`` clips decoded in the cpu
backend's worker processes (`fastdata.read.backends.video`); `on_after_batch_transfer` crops,
flips and normalizes them on the device, one draw per clip for all of its frames.
``backend="dali"`` decodes them with DALI's video decoder instead (NVDEC on a CUDA training
device; `fastdata.read.backends.dali.video`), and "auto" takes it where the training device is
a GPU, DALI is installed and the options are ones it keeps (``on_error="raise"``, no
``verify_samples``). With ``keys=True`` each batch carries ``{"key", "start", "source_id"}``:
per clip, its video's key, first frame and path in the source, to gather predictions per video.

A list of roots or `ShardSet`s is a mix of video datasets, as for `ShardDataModule`: each
dataset counts its videos times ``clips.clips`` clips (`fastdata.read.clips.clip_mix`), so the
weights (numbers or a `Schedule`), ``epoch_samples`` and the exact per-epoch counts are in clips;
every dataset is read with the same `ClipSampling` and decoded at the same side. A video dataset
mixed with an image one is refused (`fastdata.read.mix`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from typing import Any

from fastdata.augment import IMAGENET_MEAN, IMAGENET_STD, Flip, Preset, RandomResizedCrop
from fastdata.format.carve import Carve
from fastdata.format.manifest import Manifest, SplitInfo
from fastdata.format.schema import VIDEO_ENCODING
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.lightning.runtime import training_device
from fastdata.read import LoaderSpec
from fastdata.read.backends.dali import dali_status
from fastdata.read.clips import ClipSampling, ClipSpec, clip_mix

__all__ = ["VideoDataModule", "video_preset"]

log = logging.getLogger("fastdata")

#: The side of decoded frames when no ``image_size`` is given (a clip of 8 frames at 112 px is
#: 300 KB of uint8, as much as one 224 px photo... times 8 / 4).
DEFAULT_VIDEO_SIZE = 112


def _cpu_loader(spec: ClipSpec) -> Any:
    from fastdata.read.backends.video import make_video_loader

    return make_video_loader(spec)


def _dali_loader(spec: ClipSpec) -> Any:
    from fastdata.read.backends.dali.video import make_dali_video_loader

    return make_dali_video_loader(spec)


#: The video backends: name (and "auto") -> the loader of a `ClipSpec`; imported when used.
VIDEO_BACKENDS = {"auto": _cpu_loader, "cpu": _cpu_loader, "dali": _dali_loader}


def video_preset(image_size: int, scale: tuple[float, float] = (0.35, 1.0)) -> Preset:
    """The default: training clips get a random-resized crop (``scale`` of the frame) and a
    horizontal flip half of the time, the same for every frame of a clip; evaluation clips are
    used as decoded (the centre square at ``image_size``)."""
    return Preset(
        "video",
        image_size,
        IMAGENET_MEAN,
        IMAGENET_STD,
        (RandomResizedCrop(scale=scale), Flip(0.5)),
        (),
    )


class VideoDataModule(ShardDataModule):
    """Video clips from ``fastdata shard video`` shards (see the module docstring).

    Args:
        root: the shard folder, or a list of them (or of `ShardSet`s): a mix of video
            datasets, each counted in clips (the module docstring; a mix's ``epoch_samples``
            counts clips too); as `ShardDataModule`'s.
        clips: which clips each epoch reads (`ClipSampling`: frames per clip, stride or fps,
            clips per video, random or uniform starts); default 8 consecutive frames, one
            random clip per video per epoch.
        image_size: the side of the decoded frames and of the model's input (default 112).
        **kwargs: every other `ShardDataModule` option (batch_size, seed, workers, keys, ...).
            ``backend`` may be "cpu" (the clips are decoded in the cpu backend's workers),
            "dali" (DALI's video decoder, on NVDEC with a CUDA device) or "auto" (dali when
            the training device is a GPU, DALI is installed and neither ``on_error="skip"``
            nor ``verify_samples`` is asked, else cpu); ``workers`` counts
            given as "auto" start at a fixed default, since the start-up tuner times image
            loaders; with `fastdata.tune.monitor.LoaderMonitor` the cpu backend's workers then
            follow the loop's measured load at each epoch end, as for images (each clip
            batch reports its read and decode seconds).

    Raises:
        ValueError: another backend, or (at setup) a split that holds no videos, or a mix of
            video and image datasets (names both), or "dali" where DALI cannot run (the
            message says why and how to install it).
    """

    def __init__(
        self,
        root: Any,
        *,
        clips: ClipSampling | None = None,
        image_size: int | None = DEFAULT_VIDEO_SIZE,
        **kwargs: Any,
    ) -> None:
        super().__init__(root, image_size=image_size or DEFAULT_VIDEO_SIZE, **kwargs)
        if self.backend not in VIDEO_BACKENDS:
            raise ValueError(
                f"VideoDataModule decodes clips with the cpu or dali backend; got "
                f"backend={self.backend!r}: pass 'auto', 'cpu' or 'dali'"
            )
        if isinstance(self.val, float):
            # The carve draws rows of the plan, here clips: a video's clips would land on both
            # sides. Carve videos when sharding instead.
            raise ValueError(
                "VideoDataModule(val=fraction) is not supported (it would split a video's clips "
                "between training and validation); shard with --val-fraction instead"
            )
        self.clips = clips or ClipSampling()
        self.workers = _concrete(self.workers)

    def _default_train_transforms(self, name: str) -> Preset:
        assert self.image_size is not None
        return video_preset(self.image_size)

    def _check_fields(self, roles: dict[str, SplitInfo]) -> None:
        for role, info in roles.items():
            if info.encoding != VIDEO_ENCODING:
                raise ValueError(
                    f"VideoDataModule needs video splits, but the {role} split "
                    f"{self.split_names[role]!r} of {self.root} holds {info.encoding!r} "
                    "samples; write videos with `fastdata shard video SRC OUT`"
                )

    def _refuse_backend(self, roles: dict[str, SplitInfo]) -> None:
        """Nothing to refuse: `_check_fields` took video splits only, which both backends read."""

    def _choose_backend(self) -> str:
        """ "cpu", or "dali" when asked (ValueError where it cannot run) or, for "auto", when
        the training device is a GPU, DALI is available and the options are ones DALI keeps
        (``on_error="raise"``, no ``verify_samples``). Not timed: DALI's video decoder is the
        one GPU candidate, and timing it against the cpu workers needs that GPU."""
        device = training_device(self._trainer_or_none())
        if self.backend == "auto":
            if device.type != "cuda":
                ok, why = False, "a CPU training device"
            elif self.on_error != "raise" or self.verify_samples:
                ok, why = False, "on_error='skip' or verify_samples: the cpu backend's checks"
            else:
                ok, why = dali_status()
            name = "dali" if ok else "cpu"
            log.info("VideoDataModule backend=auto chose %r (%s)", name, why or "a GPU and DALI")
            return name
        if self.backend == "dali":
            ok, why = dali_status()
            if not ok:
                raise ValueError(
                    f"backend='dali' cannot run here: {why}; install NVIDIA DALI "
                    "(`pip install fastdata[dali]`) or pass backend='cpu'"
                )
        return self.backend

    def _loader_factory(self) -> Any:
        return VIDEO_BACKENDS[self.backend_name or "cpu"]

    def loader_spec(self, role: str, train: bool) -> ClipSpec:
        """The `ClipSpec` of a split role on this rank: `ShardDataModule`'s spec, read as clips."""
        spec = super().loader_spec(role, train)
        values = {f.name: getattr(spec, f.name) for f in fields(LoaderSpec)}
        if spec.window is not None:  # sized in videos: the same share of the split in clips
            values["window"] = spec.window * self.clips.clips
        return ClipSpec(**values, clips=self.clips)

    def _read_manifest(self) -> Manifest:
        """The manifest; a mix's counted in clips (`clip_mix`)."""
        return clip_mix(super()._read_manifest(), self.clips)

    def _epoch_size(self, manifest: Manifest, split: str, carve: Carve | None = None) -> int:
        """Clips in a training epoch: videos times clips per video (a mix counts clips)."""
        size = super()._epoch_size(manifest, split, carve)
        return size if self.mixed else size * self.clips.clips


def _concrete(workers: Any) -> Any:
    """`workers` with "auto" counts replaced: the tuner times image loaders, not clips."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    defaults = {"num_workers": min(4, cores or 1), "prefetch_factor": 2, "decode_threads": 1}
    given = {k: v for k, v in defaults.items() if getattr(workers, k) == "auto"}
    return replace(workers, **given) if given else workers
