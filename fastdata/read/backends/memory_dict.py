"""The memory backend for dict datasets: every field of a split resident, batches gathered.

A split that is not classification (`fastdata.read.decoders.dict_batch`) is decoded once per process
(`RowReader` + `decode_fields`, in threads) and kept in each sample's own geometry:

- images: uint8 (3, h, w) views of HWC (channels-last) pixels on the training device, at the size
  they were stored (no resize, no crop);
- masks: (h, w) per mask field on the device (uint8 when the values fit, else int32);
- boxes: float32 (k, 4) / int64 (k,) numpy arrays in source pixels (host: a few bytes each);
- labels, label, text, json and array values per sample as decoded.

Each batch of the epoch plan gathers its rows (rows skipped as corrupt under
``on_error="skip"`` are left out), draws each sample's `Region` from the plan's batch seed and
the sample's own size (`fastdata.augment.targets.draw_regions`) and moves image, masks and boxes
with it (`fastdata.read.decoders.dict_batch.warp_fields`), then collates (`collate_samples`: evaluation padding marked):
the same functions on the same inputs as the cpu backend's workers, so for the same plan
position every field equals the cpu backend's, bit for bit on the CPU. On an accelerator torch
has no uint8 antialiased resize: the image is resized with float weights (`warp_on_device`),
within a grey level of the cpu backend's; masks and boxes stay exact. The loader applies every
op of the preset (``applied_ops``); `ShardDataModule.on_after_batch_transfer` only normalizes.

Why whole frames, not one stored size: a store of one fixed size (a centre window) cuts the sides
of images whose aspect differs and loses their boxes, and a store resized to any other size
cannot give the cpu backend's masks exactly (nearest sampling of a resampled mask). The cost is
the source resolution: N x mean(h x w) x (3 + 1 per mask field) bytes (`frames_nbytes`; e.g.
640 x 480 photos with one mask: 1.2 MiB a sample, against 192 KiB for the former 256 x 256
window; measured on 200 clothing photos of mean 514 x 428 at image_size 224: 124.5 MiB, against
28.7 MiB for the former 224 x 224 store, which lost 27 of 600 boxes), which `backend="auto"`
counts before it picks this backend. Nothing is cached on disk: dict splits are decoded when the
loader is made. Epochs cost the warps only (per sample, in the training process); on the CPU an
eval epoch of those 200 photos took 1.6-8 s against the former store's 8-9 s (a busy machine).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fastdata._util.threads import one_thread_on_cpu
from fastdata.format.manifest import SplitInfo
from fastdata.read.base import LoaderSpec, PlannedLoader
from fastdata.read.decoders.dict_batch import (
    Sample,
    SampleSpec,
    collate_samples,
    decode_fields,
    sample_spec,
    warp_fields,
)
from fastdata.read.plan import EpochPlan
from fastdata.read.rows import RowReader, Skip, log_skips
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.read.source_ids import batch_keys, row_keys

__all__ = [
    "ResidentSamples",
    "frames_nbytes",
    "make_resident_loader",
    "warp_on_device",
]

log = logging.getLogger("fastdata")


class ResidentSamples(PlannedLoader):
    """A dict split decoded once, resident on the training device; batches per the epoch plan.

    Args:
        spec: the loader spec (split, plan, device, on_error).
    """

    def __init__(self, spec: LoaderSpec) -> None:
        self.spec = spec  # `_decode_split` reads it before `start_at`
        self.device = torch.device(spec.device)
        sspec = sample_spec(spec)  # the cpu backend's: the same output size and ops
        if sspec is None:
            raise ValueError(f"split {spec.split!r} is a classification split: use MemoryLoader")
        self.sample_spec: SampleSpec = sspec
        # Every op runs in `__iter__` (the regions); the DataModule only normalizes.
        self.applied_ops = len(spec.preset.ops(spec.train))
        self.values, self.ok = self._decode_split()
        self._keys: list[str] | None = None  # keys=True: every row's key, read once
        self.start_at(spec)

    def _decode_split(self) -> tuple[list[dict[str, Any] | None], torch.Tensor]:
        spec, sspec = self.spec, self.sample_spec
        sizes = spec.shard_sizes
        refs = [(s, i) for s, n in enumerate(sizes) for i in range(n)]
        skips: list[Skip] = []

        def run(chunk: list[tuple[int, int]]) -> list[dict[str, Any] | Skip]:
            reader = ShardReader(
                spec.manifest, spec.split, cache=spec.cache, verify_samples=spec.verify_samples
            )
            rows = RowReader(
                reader, sizes, train=True, on_error=spec.on_error, classification=False
            )
            out: list[dict[str, Any] | Skip] = []
            try:
                for shard, index in chunk:
                    try:
                        sample = rows.sample(shard, index)
                    except (ShardReadError, ValueError) as exc:
                        out.append(rows.fail(shard, index, exc))
                        continue
                    values = decode_fields(rows, sample, sspec)
                    out.append(values if isinstance(values, Skip) else self._to_store(values))
            finally:
                reader.close()
            return out

        workers = max(1, min(spec.workers.num_workers or os.cpu_count() or 1, 8))
        step = max(1, -(-len(refs) // (workers * 4)))
        chunks = [refs[i : i + step] for i in range(0, len(refs), step)]
        with ThreadPoolExecutor(workers, thread_name_prefix="fastdata-resident") as pool:
            results = [v for part in pool.map(run, chunks) for v in part]
        values: list[dict[str, Any] | None] = []
        for value in results:
            if isinstance(value, Skip):
                skips.append(value)
                values.append(None)
            else:
                values.append(value)
        if skips:
            log_skips(skips, set())
        ok = torch.tensor([v is not None for v in values], dtype=torch.bool)
        return values, ok

    def _to_store(self, values: dict[str, Any]) -> dict[str, Any]:
        """One decoded sample as it is kept: its own geometry, images and masks on the device."""
        out = dict(values)
        for name, field in self.sample_spec.fields.items():
            v = values[name]
            if field.kind == "image":
                t = torch.from_numpy(np.array(v)).to(self.device)  # HWC (`decode_fields`)
                # A CHW view of the HWC pixels: `as_chw` reads a (C, h, w) tensor as CHW whatever
                # its size (no guess), and the resize takes the channels-last layout without a
                # copy of the frame (as it does from the cpu backend's decoded arrays).
                out[name] = t[None] if t.dim() == 2 else t.permute(2, 0, 1)
            elif field.kind == "mask":
                t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                t = t.to(torch.int64)
                small = t.numel() == 0 or (int(t.min()) >= 0 and int(t.max()) < 256)
                out[name] = t.to(torch.uint8 if small else torch.int32).to(self.device)
            elif field.kind == "boxes":  # warped on the host in float64, as the cpu backend does
                b, c = v
                out[name] = (
                    np.asarray(b, dtype=np.float32).reshape(-1, 4),
                    np.asarray(c, dtype=np.int64).reshape(-1),
                )
        return out

    @property
    def skipped(self) -> int:
        """Samples skipped under on_error='skip' (left out of every batch; logged once)."""
        return int((~self.ok).sum())

    def _iterate(self, plan: EpochPlan) -> Iterator[Sample]:
        train = self.spec.train
        for rows, pad, seed in zip(plan.rows, plan.padding, plan.seeds, strict=True):
            kept = [(int(r), bool(p) and not train) for r, p in zip(rows, pad, strict=True)]
            kept = [(r, p) for r, p in kept if self.values[r] is not None]
            samples = self._warp([self.values[r] for r, _ in kept], int(seed))  # type: ignore[misc]
            keys = None
            if self.spec.keys:  # `fastdata.read.source_ids`
                keys = batch_keys(self._row_keys(), [r for r, _ in kept], [p for _, p in kept])
            batch = collate_samples(samples, [p for _, p in kept], self.sample_spec, keys)
            yield _on(batch, self.device)

    def _row_keys(self) -> list[str]:
        if self._keys is None:
            self._keys = row_keys(self.spec)
        return self._keys

    def _warp(self, samples: list[dict[str, Any]], batch_seed: int) -> list[dict[str, Any]]:
        """The batch's samples moved by their regions, as `dict_batch.decode_samples` moves them."""
        sspec = self.sample_spec
        if sspec.out_hw is None or sspec.image is None or not samples:
            return samples
        from fastdata.augment.targets import draw_regions

        sizes = [tuple(v[sspec.image].shape[-2:]) for v in samples]
        regions = draw_regions(sspec.preset, sspec.train, sizes, sspec.out_hw, batch_seed)
        warp = warp_fields if self.device.type == "cpu" else warp_on_device
        with one_thread_on_cpu(self.device):
            return [warp(v, sspec, r) for v, r in zip(samples, regions, strict=True)]


def warp_on_device(values: dict[str, Any], spec: SampleSpec, region: Any) -> dict[str, Any]:
    """`dict_batch.warp_fields` of a sample whose image and masks live on an accelerator.

    torch resizes uint8 with antialiasing on the CPU only (`warp_sample`'s fast path), so the
    image takes `warp_images`' float weights on its device, rounded (within a grey level of
    `warp_sample`, as `warp_batch`); masks (`warp_masks`) and boxes (`warp_boxes`, on the host)
    move by the same functions as in `warp_sample`, exactly.
    """
    from fastdata.augment.targets import warp_boxes
    from fastdata.augment.warp import gatherable, warp_images, warp_masks

    out = dict(values)
    image = values[spec.image]
    hw = (int(image.shape[-2]), int(image.shape[-1]))
    out[spec.image] = warp_images(image[None], [region], True, torch.uint8)[0]
    for name, field in spec.fields.items():
        if field.kind == "mask":
            mask = gatherable(values[name].to(torch.int64))
            out[name] = warp_masks(mask[None], [region], spec.ignore_index)[0]
        elif field.kind == "boxes":
            b, c = values[name]
            kept, labels = warp_boxes(torch.from_numpy(b), torch.from_numpy(c), region, hw)
            out[name] = (kept, labels)
    return out


def _on(batch: Sample, device: torch.device) -> Sample:
    """Tensors of the batch on `device` (a no-op for those already there)."""
    out = Sample()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.to(device)
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            out[key] = [v.to(device) for v in value]
        else:
            out[key] = value
    return out


def frames_nbytes(info: SplitInfo) -> int | None:
    """Estimated bytes of a dict split's resident store (see the module docstring), or None when
    the manifest does not say how large its images are (no `image_stats` and no `raw_shape`).

    Images at their own size (3 bytes a pixel) and each mask field (1 byte a pixel, the common
    case of fewer than 256 classes): N x mean height x mean width x (3 + masks); boxes and the
    other fields are not counted (a few bytes a sample).
    """
    masks = sum(1 for f in info.field_specs.values() if f.kind == "mask")
    if info.raw_shape is not None:
        h, w = float(info.raw_shape[0]), float(info.raw_shape[1])
    elif info.image_stats.get("mean_height") and info.image_stats.get("mean_width"):
        h, w = float(info.image_stats["mean_height"]), float(info.image_stats["mean_width"])
    else:
        return None
    return int(math.ceil(info.num_samples * h * w * (3 + masks)))


def make_resident_loader(spec: LoaderSpec) -> ResidentSamples:
    """The memory backend's loader of a dict split (see the module docstring)."""
    return ResidentSamples(spec)
