"""The memory backend for dict datasets: every field of a split resident, batches gathered.

A split that is not classification (`fastdata.read.samples`) is decoded once per process
(`RowReader` + `decode_fields`, in threads) into:

- images: uint8 (N, 3, H, W) on the training device at the stored size (`decode.stored_hw`:
  the split's own size when every image shares it, else the centre window covering
  ``floor(S * 256 / 224)`` (S when the preset does not crop) squared); an image of another size
  is moved there by a `Region` covering that window, with its masks and boxes (`warp_sample`);
- masks: one (N, H, W) tensor per mask field on the device (uint8 when the values fit, else
  int32; int64 in the batch);
- boxes: per-sample float32 (k, 4) / int64 (k,) tensors on the device;
- labels (multi-hot float32), label (int64), text, json and array values per sample.

Each batch of the epoch plan gathers its rows (rows skipped as corrupt under
``on_error="skip"`` are left out), marks evaluation padding (mask all `ignore_index`, no boxes,
label -100, multi-hot zeros) and is yielded at the stored size: the preset's ops run batched on
the device in `ShardDataModule.on_after_batch_transfer` (`finish_sample`: the regions
drawn from the plan's batch seed move image, masks and boxes together), then normalizing.
Nothing is cached on disk: dict splits are decoded when the loader is made.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fastdata.augment import Preset
from fastdata.fields import FieldSpec
from fastdata.read.base import LoaderSpec
from fastdata.read.decode import stored_hw
from fastdata.read.plan import EpochPlan
from fastdata.read.rows import RowReader, Skip, log_skips
from fastdata.read.samples import (
    Sample,
    SampleSpec,
    box_labels_key,
    collate_samples,
    decode_fields,
    sample_spec,
)
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.read.source_ids import batch_keys, row_keys

__all__ = ["ResidentSamples", "finish_sample", "make_resident_loader"]

log = logging.getLogger("fastdata")


class ResidentSamples:
    """A dict split decoded once, resident on the training device; batches per the epoch plan.

    Args:
        spec: the loader spec (split, plan, device, on_error).
    """

    normalized = False
    applied_ops = 0  # the DataModule warps the stored-size batch on the device

    def __init__(self, spec: LoaderSpec) -> None:
        info = spec.manifest.split(spec.split)
        self.spec = spec
        self.device = torch.device(spec.device)
        self.hw = stored_hw(info, spec.image_size, margin=spec.preset.resizes(spec.train))
        sspec = sample_spec(spec, out_hw=self.hw)
        if sspec is None:
            raise ValueError(f"split {spec.split!r} is a classification split: use MemoryLoader")
        self.sample_spec: SampleSpec = sspec
        self.values, self.ok = self._decode_split()
        self._keys: list[str] | None = None  # keys=True: every row's key, read once
        self.set_epoch(spec.epoch, spec.consumed, spec.steps_before)

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
        """One sample at the stored size (a covering region when its image has another)."""
        sspec = self.sample_spec
        image = values[sspec.image] if sspec.image else None  # None: an image-less split
        if (
            image is not None and tuple(image.shape[:2]) != self.hw
        ):  # the "cover" geometry of the decoded cache
            from fastdata.augment.targets import cover_region
            from fastdata.read.samples import warp_fields

            values = warp_fields(values, sspec, cover_region(image.shape[:2], self.hw))
        out = {}
        for name, field in sspec.fields.items():
            v = values[name]
            if field.kind == "image":
                t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                if t.shape[-1] == 3 and t.shape[0] != 3:  # HWC from the decoder
                    t = t.permute(2, 0, 1)
                v = t.contiguous().to(self.device)
            elif field.kind == "mask":
                t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                t = t.to(torch.int64)
                small = t.numel() == 0 or int(t.max()) < 256
                v = t.to(torch.uint8 if small else torch.int32).to(self.device)
            elif field.kind == "boxes":
                b, c = v
                b = torch.as_tensor(b, dtype=torch.float32).reshape(-1, 4)
                v = (b.to(self.device), torch.as_tensor(c, dtype=torch.int64).to(self.device))
            out[name] = v
        return out

    @property
    def skipped(self) -> int:
        """Samples skipped under on_error='skip' (left out of every batch; logged once)."""
        return int((~self.ok).sum())

    def set_epoch(self, epoch: int, consumed: int = 0, steps_before: int = 0) -> None:
        """Select epoch `epoch`'s plan from `consumed` samples on (resume)."""
        self.plan: EpochPlan = self.spec.plan(epoch, consumed, steps_before)

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Sample]:
        plan, train = self.plan, self.spec.train
        for rows, pad in zip(plan.rows, plan.padding, strict=True):
            kept = [(int(r), bool(p) and not train) for r, p in zip(rows, pad, strict=True)]
            kept = [(r, p) for r, p in kept if self.values[r] is not None]
            samples = [self.values[r] for r, _ in kept]
            keys = None
            if self.spec.keys:  # `fastdata.read.source_ids`
                keys = batch_keys(self._row_keys(), [r for r, _ in kept], [p for _, p in kept])
            batch = collate_samples(samples, [p for _, p in kept], self.sample_spec, keys)  # type: ignore[arg-type]
            yield _on(batch, self.device)

    def _row_keys(self) -> list[str]:
        if self._keys is None:
            self._keys = row_keys(self.spec)
        return self._keys


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


def make_resident_loader(spec: LoaderSpec) -> ResidentSamples:
    """The memory backend's loader of a dict split (see the module docstring)."""
    return ResidentSamples(spec)


def finish_sample(
    batch: Mapping[str, Any],
    fields: Mapping[str, FieldSpec],
    preset: Preset,
    train: bool,
    batch_seed: int,
    applied: int,
    ignore_index: int = 255,
) -> Sample:
    """A dict batch with the preset's ops the loader left applied on its device (`warp_batch`).

    The cpu backend applies every op in its workers (`applied` = all of them): the batch is
    returned as it is (a copy of the same type). The memory backend applies none: each sample's
    `Region` is drawn from `batch_seed` for the stored size and the image, masks and boxes move
    together, batched on the device. Normalizing is left to the caller.
    """
    out = type(batch)(batch)
    ops = preset.ops(train)
    if "image" not in out or (applied >= len(ops) and preset.image_size is None):
        return out  # an image-less split's batch has nothing to warp
    image = out["image"]
    n, _, h, w = image.shape
    if n == 0:
        return out
    out_hw = (preset.image_size, preset.image_size) if preset.image_size else (h, w)
    if applied >= len(ops) and (h, w) == out_hw:
        return out
    from fastdata.augment.targets import draw_regions, warp_batch

    regions = draw_regions(preset, train, [(h, w)] * n, out_hw, batch_seed)
    masks = [k for k, f in fields.items() if f.kind == "mask" and k in out]
    boxes = [k for k, f in fields.items() if f.kind == "boxes" and k in out]
    first: dict[str, Any] = {}
    if masks:
        first["masks"] = out[masks[0]]
    if boxes:
        first["boxes"], first["box_labels"] = out[boxes[0]], out[box_labels_key(boxes[0])]
    warped = warp_batch(image, regions, ignore_index=ignore_index, **first)
    out["image"] = warped["image"]
    if masks:
        out[masks[0]] = warped["mask"]
    if boxes:
        out[boxes[0]], out[box_labels_key(boxes[0])] = warped["boxes"], warped["box_labels"]
    for name in masks[1:]:
        out[name] = warp_batch(image, regions, masks=out[name], ignore_index=ignore_index)["mask"]
    for name in boxes[1:]:
        key = box_labels_key(name)
        w2 = warp_batch(image, regions, boxes=out[name], box_labels=out[key])
        out[name], out[key] = w2["boxes"], w2["box_labels"]
    return out
