"""The nvjpeg backend: shards -> epoch plan -> JPEG bytes -> nvJPEG decode on the GPU -> uint8 batches.

For users who have torchvision but not DALI. Per batch of the plan (`fastdata.read.plan`), in a
pipeline of three threads, so that batch k + 2 is read while batch k + 1 is decoded and batch k
is cropped and resized:

1. read (a thread): the batch's encoded bytes and labels (`read_batch`), and the crop window and
   flip of every JPEG whose frame header gives its size (`fastdata.read.decoders.jpeg_header`);
2. decode (a second thread, on its own CUDA stream): JPEGs in one call to
   ``torchvision.io.decode_jpeg(list, device="cuda")`` (nvJPEG, batched). A JPEG nvJPEG refuses
   (CMYK, 12-bit, ...) is decoded on the CPU by Pillow, as the cpu backend would, and counted
   (`NvjpegLoader.cpu_fallbacks`); it goes straight to the CPU in later epochs. PNG and other
   encodings are decoded on the CPU too. Only a sample no decoder reads is a `ShardReadError`;
3. geometry (the calling thread): each sample's window and flip come from
   `fastdata.read.decoders.image.draw_crop`, the cpu backend's own draw, with the same
   per-sample generator (`plan.sample_seed`): one geometry for every backend. The crop + resize
   is batched (`fastdata.read.backends.crop_resize`: a few ops per distinct image size, not ~5
   kernel launches per image), giving one uint8 NCHW batch on the device.

Where the time went before this pipeline (benchmarks/gpu_nvjpeg_stages.py, H200, clothing-small,
128 photos of ~400 x 534 a batch, 2026-12-04): read 1.9 ms, nvJPEG decode 8.0 ms, box draws
4.1 ms, crop + resize 5.8-9.3 ms, one after the other on one thread. The decode (~16,000
images/s alone) is the floor this pipeline aims at.

Pixels differ slightly from the cpu backend's (another JPEG decoder and resampler); the regions
and flips are the same. The device augmentation left (normalize, ...) runs in
`ShardDataModule.on_after_batch_transfer`, as for the cpu backend.

The GPU decode call is injectable (`Decoder`), so everything but that call is tested on the CPU.
torchvision is imported on first use only.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastdata.read.backends.cpu_batches import decode_geometry
from fastdata.read.backends.crop_resize import Box, crop_resize
from fastdata.read.base import LoaderSpec, PlannedLoader
from fastdata.read.decoders.dict_batch import refuse_fields
from fastdata.read.decoders.image import Geometry, decode_image, draw_crop
from fastdata.read.decoders.jpeg_header import jpeg_size
from fastdata.read.plan import EpochPlan, sample_seed
from fastdata.read.rows import RowReader
from fastdata.read.shardio import ShardReader, ShardReadError

__all__ = [
    "Decoder",
    "DecodedBatch",
    "EncodedBatch",
    "NvjpegLoader",
    "crop_resize",
    "draw_box",
    "make_nvjpeg_loader",
    "nvjpeg_available",
    "nvjpeg_status",
    "read_batch",
]

#: Decodes a list of 1-D uint8 CPU tensors (JPEG bytes) to a list of CHW uint8 device tensors.
Decoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]

_JPEG_EXTS = frozenset({"jpg", "jpeg"})

_log = logging.getLogger("fastdata")


def nvjpeg_status() -> tuple[bool, str]:
    """(usable here, reason when not): a CUDA GPU and torchvision with GPU JPEG decoding.

    Creates no CUDA context (the GPU count comes from NVML) and never raises.
    """
    try:
        if torch.cuda.device_count() < 1:
            return False, "no CUDA GPU is visible"
        if importlib.util.find_spec("torchvision") is None:
            return False, "torchvision is not installed (`pip install torchvision`)"
        from torchvision.io import decode_jpeg  # noqa: F401 - GPU decode lives here
    except Exception as exc:  # noqa: BLE001 - a broken install is "unavailable", with its reason
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def nvjpeg_available() -> bool:
    """True when `nvjpeg_status` says the backend can run here."""
    return nvjpeg_status()[0]


def torchvision_decoder(device: torch.device) -> Decoder:
    """torchvision's batched nvJPEG decode to RGB on `device` (imported here, on first use)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    return decode


# ---------------------------------------------------------------------------- pure pieces


@dataclass(frozen=True)
class EncodedBatch:
    """One batch of the plan, read but not decoded.

    Attributes:
        number: the batch's number in the plan.
        payloads: encoded (or raw) image bytes, one per kept sample.
        exts: each payload's component name ("jpg", "png", "rgb", ...).
        labels: int64 labels (`PAD_LABEL` for evaluation padding).
        positions: each sample's position in the epoch order (its generator's seed).
        keys: (shard number, index in shard) of each sample, for error messages.
        sample_keys: `LoaderSpec.keys`: each sample's key (None for padding); else empty.
        draws: per sample, ((height, width) from the JPEG header, crop window, flip) drawn in the
            read thread; None where the header gave no size (PNG, ...: drawn after decoding).
            Empty when `read_batch` was given no geometry.
    """

    number: int
    payloads: list[bytes]
    exts: list[str]
    labels: list[int]
    positions: list[int]
    keys: list[tuple[int, int]]
    sample_keys: list[str | None] = field(default_factory=list)
    draws: list[tuple[tuple[int, int], Box, bool] | None] = field(default_factory=list)


@dataclass(frozen=True)
class DecodedBatch:
    """A read batch and its images decoded on the device (CHW uint8, at their stored sizes)."""

    batch: EncodedBatch
    images: list[torch.Tensor]


def read_batch(
    reader: ShardReader,
    spec: LoaderSpec,
    plan: EpochPlan,
    number: int,
    geometry: Geometry | None = None,
) -> EncodedBatch:
    """The bytes and labels of batch `number` of `plan` (errors name shard and key).

    With `geometry`, also each JPEG's crop window and flip (`EncodedBatch.draws`), drawn from the
    size in its header exactly as `NvjpegLoader.decode_batch` would draw them after decoding.
    """
    rows = RowReader(reader, spec.shard_sizes, train=spec.train)  # on_error="raise" only
    batch = EncodedBatch(number, [], [], [], [], [])
    read = rows.read(plan, number)
    for slot, label, (ext, data) in zip(read.slots, read.labels, read.images, strict=True):
        batch.payloads.append(bytes(data))
        batch.exts.append(ext)
        batch.labels.append(label)
        batch.positions.append(read.positions[slot])
        batch.keys.append(tuple(read.refs[slot]))
        if spec.keys:  # read here, in the one thread that uses the reader
            padded = read.padded[slot]
            batch.sample_keys.append(None if padded else reader.key(*read.refs[slot]))
        if geometry is not None:
            size = jpeg_size(data) if ext in _JPEG_EXTS else None
            position = read.positions[slot]
            batch.draws.append(
                None
                if size is None
                else (size, *draw_box(size, geometry, spec, plan.epoch, position))
            )
    return batch


def draw_box(
    size: tuple[int, int], geometry: Geometry, spec: LoaderSpec, epoch: int, position: int
) -> tuple[Box, bool]:
    """The crop window (left, top, right, bottom) and flip of the sample at `position` of the
    epoch, for an image of `size` (height, width): `draw_crop` with the sample's generator, the
    cpu backend's draws."""
    rng = np.random.default_rng(sample_seed(spec.seed, epoch, position))
    return draw_crop((size[1], size[0]), geometry, rng)


# ---------------------------------------------------------------------------- loader


class NvjpegLoader(PlannedLoader):
    """One rank's batches of a split: JPEGs decoded with nvJPEG, cropped and resized on the GPU.

    Args:
        spec: what to load; ``spec.device`` must be a CUDA device for the default decoder.
        decoder: the batched JPEG decode (default: `torchvision_decoder` on ``spec.device``).

    Attributes:
        normalized: always False (uint8 batches; normalization runs on the device later).
        augmented: always False (the same, under the name the DataModule may read).
        applied_ops: preset ops fused into decoding (the decode-time crop and flip).
        cpu_fallbacks: JPEG decodes that nvJPEG refused and the CPU did, over the loader's life.
    """

    augmented = False

    def __init__(self, spec: LoaderSpec, decoder: Decoder | None = None) -> None:
        info = spec.manifest.split(spec.split)
        if info.encoding == "raw":
            raise ValueError(
                f"split {spec.split!r} of {spec.manifest.root} holds raw pixels: nothing to decode "
                "with nvJPEG; use backend='memory' or 'cpu'"
            )
        refuse_fields(spec, "nvjpeg")
        if spec.on_error != "raise":
            raise ValueError(
                f"the nvjpeg backend supports on_error='raise' only, got {spec.on_error!r}: run "
                "`fastdata verify` on the shard folder, or use backend='cpu' to skip bad samples"
            )
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is None:
            # The decode thread's current device is GPU 0 whatever the rank's: name the GPU.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.geometry, self.applied_ops = decode_geometry(spec)
        if self.geometry.kind == "none" or min(self.geometry.out_hw) < 1:
            raise ValueError(
                f"the nvjpeg backend needs an output size for split {spec.split!r}: pass "
                "image_size (or a preset with a decode-time crop)"
            )
        self._decode = decoder if decoder is not None else torchvision_decoder(self.device)
        self.cpu_fallbacks = 0
        self._refused: set[tuple[int, int]] = set()  # (shard, index) nvJPEG refused before
        self._last_refusal = ""  # nvJPEG's error for the last JPEG it refused
        self._stream = None  # the decode thread's CUDA stream, created in that thread
        self.start_at(spec)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        reader = ShardReader(
            self.spec.manifest,
            self.spec.split,
            cache=self.spec.cache,
            verify_samples=self.spec.verify_samples,
        )
        n, g = len(plan.rows), self.geometry
        read_pool = ThreadPoolExecutor(1, thread_name_prefix="fastdata-nvjpeg-read")
        decode_pool = ThreadPoolExecutor(1, thread_name_prefix="fastdata-nvjpeg-decode")

        def read(k: int) -> Future[EncodedBatch] | None:
            return read_pool.submit(read_batch, reader, self.spec, plan, k, g) if k < n else None

        # The stream the batches are used on (the caller's): decoded images are kept from reuse
        # by the decode stream until the work queued on it has read them.
        consumer = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def decode(pending: Future[EncodedBatch] | None) -> Future[DecodedBatch] | None:
            if pending is None:
                return None
            return decode_pool.submit(self._stage, pending, reader, consumer)

        try:
            decoding = decode(read(0))
            reading = read(1)
            for _ in range(n):
                staged = decoding.result()  # type: ignore[union-attr] - one per batch number
                decoding, reading = decode(reading), read(staged.batch.number + 2)
                out = self._finish(staged, plan.epoch)
                yield (*out, staged.batch.sample_keys) if self.spec.keys else out
        finally:
            decode_pool.shutdown(wait=True, cancel_futures=True)
            read_pool.shutdown(wait=True, cancel_futures=True)
            reader.close()

    def _stage(
        self, pending: Future[EncodedBatch], reader: ShardReader, consumer: Any = None
    ) -> DecodedBatch:
        """The decode thread: the read batch's images decoded on its own CUDA stream, ready (the
        stream synchronized) and handed to `consumer`, the calling thread's stream."""
        batch = pending.result()
        if self.device.type != "cuda":
            return DecodedBatch(batch, self._decode_all(batch, reader))
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        consumer = consumer or torch.cuda.default_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            images = self._decode_all(batch, reader)
        self._stream.synchronize()
        for image in images:  # freed memory is not reused by this stream while the other reads
            image.record_stream(consumer)
        return DecodedBatch(batch, images)

    def decode_batch(
        self, batch: EncodedBatch, epoch: int, reader: ShardReader | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, crop, resize (and flip) one read batch: (uint8 NCHW, int64) on the device."""
        return self._finish(DecodedBatch(batch, self._decode_all(batch, reader)), epoch)

    def _finish(self, staged: DecodedBatch, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Crop, resize and flip a decoded batch (windows drawn in the read thread where the
        header gave the decoded size): (uint8 NCHW, int64) on the device."""
        batch, images = staged.batch, staged.images
        boxes, flips = [], []
        drawn = batch.draws or [None] * len(images)
        for image, position, early in zip(images, batch.positions, drawn, strict=True):
            size = (int(image.shape[1]), int(image.shape[2]))
            if early is None or early[0] != size:  # no header size, or the decoder disagrees
                early = (size, *draw_box(size, self.geometry, self.spec, epoch, position))
            boxes.append(early[1])
            flips.append(early[2])
        x = crop_resize(images, boxes, self.geometry.out_hw, flips)
        y = torch.tensor(batch.labels, dtype=torch.int64).to(self.device, non_blocking=True)
        return x, y

    def _decode_all(self, batch: EncodedBatch, reader: ShardReader | None) -> list[torch.Tensor]:
        """Every image of the batch as CHW uint8 on the device, at its stored size."""
        images: list[torch.Tensor | None] = [None] * len(batch.payloads)
        jpegs = [
            i
            for i, ext in enumerate(batch.exts)
            if ext in _JPEG_EXTS and batch.keys[i] not in self._refused
        ]
        if jpegs:
            data = [
                torch.frombuffer(bytearray(batch.payloads[i]), dtype=torch.uint8) for i in jpegs
            ]
            try:
                decoded: list[torch.Tensor | None] = list(self._decode(data))
            except torch.cuda.OutOfMemoryError:
                raise  # the device's trouble, not the JPEGs': none is marked refused
            except Exception:  # noqa: BLE001 - find the samples nvJPEG refuses, one by one
                decoded = [self._decode_one(t) for t in data]
            for i, image in zip(jpegs, decoded, strict=True):
                if image is None:
                    self._refuse(batch, i, reader)
                images[i] = image
        for i in range(len(images)):
            if images[i] is None:  # refused by nvJPEG, or PNG, WebP, ...: Pillow on the CPU
                images[i] = self._decode_on_cpu(batch, i, reader)
                self.cpu_fallbacks += batch.exts[i] in _JPEG_EXTS
        return images  # type: ignore[return-value] - every slot is filled above

    def _decode_one(self, data: torch.Tensor) -> torch.Tensor | None:
        """One JPEG through nvJPEG; None when it refuses it (the CPU decodes it then)."""
        try:
            return self._decode([data])[0]
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused: decoded on the CPU, logged once
            self._last_refusal = f"{type(exc).__name__}: {exc}"
            return None

    def _refuse(self, batch: EncodedBatch, i: int, reader: ShardReader | None) -> None:
        """Remember a JPEG nvJPEG refused (the CPU decodes it from now on); log the first."""
        if not self._refused:
            where = _sample_error(reader, *batch.keys[i], ValueError("refused by nvJPEG"))
            _log.warning(
                "nvjpeg backend: %s (%s); such JPEGs are decoded on the CPU and counted in "
                "the loader's cpu_fallbacks",
                where, self._last_refusal or "no reason given",
            )  # fmt: skip
        self._refused.add(batch.keys[i])

    def _decode_on_cpu(self, batch: EncodedBatch, i: int, reader) -> torch.Tensor:
        rng = np.random.default_rng(0)  # geometry "none" draws nothing
        try:
            pixels = decode_image(batch.payloads[i], Geometry("none"), rng)
        except ValueError as exc:
            raise _sample_error(reader, *batch.keys[i], exc) from exc
        return torch.tensor(pixels).permute(2, 0, 1).to(self.device, non_blocking=True)


def make_nvjpeg_loader(spec: LoaderSpec) -> NvjpegLoader:
    """The nvjpeg backend's loader for one split on one rank."""
    return NvjpegLoader(spec)


def _sample_error(
    reader: ShardReader | None, shard: int, index: int, exc: Exception
) -> ShardReadError:
    if isinstance(exc, ShardReadError):
        return exc
    if reader is None:
        return ShardReadError(f"shard #{shard}", f"#{index}", str(exc))
    rows = RowReader(reader, (), train=False)
    return rows.error(shard, index, ValueError(f"{type(exc).__name__}: {exc}"))
