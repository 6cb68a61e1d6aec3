"""The nvjpeg backend: shards -> epoch plan -> JPEG bytes -> nvJPEG decode on the GPU -> uint8 batches.

For users who have torchvision but not DALI. Per batch of the plan (`fastdata.read.plan`):

1. read: the batch's encoded bytes and labels on the CPU (`read_batch`; a background thread reads
   the next batch while the GPU decodes this one), and the crop box and flip of every JPEG whose
   frame header gives its size (`fastdata.read.decoders.jpeg_header`), drawn there too so the
   draws overlap the decode;
2. decode: JPEGs in one call to ``torchvision.io.decode_jpeg(list, device="cuda")`` (nvJPEG,
   batched); PNG and other encodings on the CPU (`fastdata.read.decoders.image`), then copied over;
3. geometry: each sample's crop box is drawn exactly as the cpu backend draws it
   (`fastdata.augment.rrc_params` for "rrc", the ``size * 256 / 224`` centre rule for "center",
   the covering centre window for "cover"), from the same per-sample generator
   (`plan.sample_seed`), so both backends crop the same region of every image; then the flip;
4. crop + resize on the device (`crop_resize`: bilinear with antialiasing, like Pillow's
   boxed resize, one resize per image; rounding, flips and the uint8 cast once per batch),
   giving one uint8 NCHW batch on the device.

Where the time goes (benchmarks/gpu_nvjpeg_stages.py, H200, clothing-small, 128 photos of
~400 x 534 a batch, 2026-12-04): read 1.9 ms, nvJPEG decode 8.0 ms, box draws 4.1 ms, crop +
resize 9.3 ms with a full per-image tail, 5.8 ms with the batched tail (same pixels). The
decode is the floor of this backend (~16,000 images/s alone); DALI decodes and crops in one
pipeline.

Pixels differ slightly from the cpu backend's (another JPEG decoder and resampler; "cover" boxes
are rounded to whole pixels); the regions and flips are the same. The device augmentation left
(normalize, ...) runs in `ShardDataModule.on_after_batch_transfer`, as for the cpu backend.

The GPU decode call is injectable (`Decoder`), so everything but that call is tested on the CPU.
torchvision is imported on first use only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fastdata.read.backends.cpu_batches import decode_geometry
from fastdata.read.base import LoaderSpec, PlannedLoader
from fastdata.read.decoders.dict_batch import refuse_fields
from fastdata.read.decoders.image import Geometry, decode_image
from fastdata.read.decoders.jpeg_header import jpeg_size
from fastdata.read.plan import EpochPlan, sample_seed
from fastdata.read.rows import RowReader
from fastdata.read.shardio import ShardReader, ShardReadError

__all__ = [
    "Decoder",
    "EncodedBatch",
    "NvjpegLoader",
    "crop_box",
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
Box = tuple[int, int, int, int]  # top, left, height, width


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
        draws: per sample, ((height, width) from the JPEG header, crop box, flip) drawn in the
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


def read_batch(
    reader: ShardReader,
    spec: LoaderSpec,
    plan: EpochPlan,
    number: int,
    geometry: Geometry | None = None,
) -> EncodedBatch:
    """The bytes and labels of batch `number` of `plan` (errors name shard and key).

    With `geometry`, also each JPEG's crop box and flip (`EncodedBatch.draws`), drawn from the
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
    """The crop box and flip of the sample at `position` of the epoch, for an image of `size`
    (height, width): the same draws, in the same order, as the cpu backend's decode."""
    rng = np.random.default_rng(sample_seed(spec.seed, epoch, position))
    box = crop_box(size[0], size[1], geometry, rng)
    return box, bool(geometry.flip_p > 0 and rng.random() < geometry.flip_p)


def crop_box(height: int, width: int, geometry: Geometry, rng: np.random.Generator) -> Box:
    """(top, left, h, w) of the region the cpu backend crops from an image of this size.

    Draws from `rng` exactly as `fastdata.read.decoders.image.decode_image` does (the box first), so the
    caller's flip draw comes next, as there.
    """
    if geometry.kind == "rrc":
        from fastdata.augment import rrc_params

        return rrc_params(height, width, geometry.scale, geometry.ratio, rng)
    if geometry.kind == "center":
        side = max(1, round(min(width, height) / geometry.resize_ratio))
        return (height - side) // 2, (width - side) // 2, side, side
    if geometry.kind == "cover":
        th, tw = geometry.hw
        cover = max(tw / width, th / height)  # the window of the image that covers `hw`
        h, w = min(height, max(1, round(th / cover))), min(width, max(1, round(tw / cover)))
        return (height - h) // 2, (width - w) // 2, h, w
    return 0, 0, height, width


def crop_resize(
    images: Sequence[torch.Tensor],
    boxes: Sequence[Box],
    out_hw: tuple[int, int],
    flips: Sequence[bool],
) -> torch.Tensor:
    """Crop each CHW uint8 image to its box, resize to `out_hw`, mirror where flagged: NCHW uint8.

    Runs on the images' device: bilinear with antialiasing (like Pillow's boxed resize), one
    resize per image (their sizes differ) written into one float batch; the rounding, clamping,
    flips and uint8 cast then run once for the batch (a third fewer kernel launches than per
    image, which is what this step's time is on a GPU: 9.3 -> 5.8 ms for 128 photos on an H200).
    """
    if not images:
        raise ValueError("crop_resize needs at least one image")
    if len(flips) != len(images):
        raise ValueError(f"crop_resize: {len(images)} images but {len(flips)} flips")
    out = torch.empty((len(images), 3, *out_hw), dtype=torch.float32, device=images[0].device)
    for i, (image, (top, left, h, w)) in enumerate(zip(images, boxes, strict=True)):
        crop = image[:3, top : top + h, left : left + w]
        if (h, w) != tuple(out_hw):
            out[i] = F.interpolate(
                crop.unsqueeze(0).float(),
                size=out_hw,
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )[0]
        else:
            out[i] = crop  # an exact crop: cast, no resampling
    if any(flips):
        flip = torch.tensor(list(flips), dtype=torch.bool).to(out.device, non_blocking=True)
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


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
        self.geometry, self.applied_ops = decode_geometry(spec)
        if self.geometry.kind == "none" or min(self.geometry.out_hw) < 1:
            raise ValueError(
                f"the nvjpeg backend needs an output size for split {spec.split!r}: pass "
                "image_size (or a preset with a decode-time crop)"
            )
        self._decode = decoder if decoder is not None else torchvision_decoder(self.device)
        self.start_at(spec)

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        reader = ShardReader(
            self.spec.manifest,
            self.spec.split,
            cache=self.spec.cache,
            verify_samples=self.spec.verify_samples,
        )
        # One thread reads batch k + 1 from the shards while the GPU decodes batch k.
        with ThreadPoolExecutor(1, thread_name_prefix="fastdata-nvjpeg-read") as pool:
            try:
                pending: Future[EncodedBatch] | None = None
                for number in range(len(plan.rows)):
                    g = self.geometry
                    if pending is None:
                        pending = pool.submit(read_batch, reader, self.spec, plan, number, g)
                    batch = pending.result()
                    if number + 1 < len(plan.rows):
                        pending = pool.submit(read_batch, reader, self.spec, plan, number + 1, g)
                    out = self.decode_batch(batch, plan.epoch, reader)
                    yield (*out, batch.sample_keys) if self.spec.keys else out
            finally:
                reader.close()

    def decode_batch(
        self, batch: EncodedBatch, epoch: int, reader: ShardReader | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, crop, resize (and flip) one read batch: (uint8 NCHW, int64) on the device."""
        images = self._decode_all(batch, reader)
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
        jpegs = [i for i, ext in enumerate(batch.exts) if ext in _JPEG_EXTS]
        if jpegs:
            data = [
                torch.frombuffer(bytearray(batch.payloads[i]), dtype=torch.uint8) for i in jpegs
            ]
            try:
                decoded = self._decode(data)
            except Exception as exc:  # noqa: BLE001 - find and name the sample that fails
                decoded = [
                    self._decode_one(batch, i, t, reader, exc)
                    for i, t in zip(jpegs, data, strict=True)
                ]
            for i, image in zip(jpegs, decoded, strict=True):
                images[i] = image
        for i in range(len(images)):
            if images[i] is None:  # PNG, WebP, ...: Pillow on the CPU, then to the device
                images[i] = self._decode_on_cpu(batch, i, reader)
        return images  # type: ignore[return-value] - every slot is filled above

    def _decode_one(self, batch, i, data, reader, batch_error: Exception) -> torch.Tensor:
        try:
            return self._decode([data])[0]
        except Exception as exc:  # noqa: BLE001 - this sample is the bad one: name it
            raise _sample_error(reader, *batch.keys[i], exc) from batch_error

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
