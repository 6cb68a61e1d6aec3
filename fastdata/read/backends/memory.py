"""The device-resident backend: decode a split once, keep it on the training device as uint8.

airbench-style: the whole split lives on the device (`fastdata.read.stores.decoded_cache` decodes it once
with the one CPU decoder and caches it on disk), one row per sample in row order; every batch of
the epoch plan (`fastdata.read.plan`, the same plan as every other backend) is a gather of its
rows. Nothing is decoded per epoch. Building the store (decode or copy once, then pad and mirror)
runs in threads; on large splits local rank 0 shows a progress bar (`decode_split`'s
`progress`). Two store layouts:

- Fused pad-crop (training with a preset whose train ops are exactly one `PadCrop`:
  `Preset.pad_crop`): the store is `fastdata.read.stores.padded.PaddedImages`, pre-padded and mirrored,
  and the loader itself draws the crop offsets and flips (`fastdata.augment.pad_crop_params`) from
  the plan's batch seed and gathers the windows in one pass: it yields the augmented uint8 batch
  (``applied_ops = 1``), and `ShardDataModule.on_after_batch_transfer` normalizes it; the result
  equals the preset's `apply` on the selected images with a generator seeded with the same batch
  seed (tested), i.e. what the DataModule makes of the cpu backend's batch.
- Otherwise: the decoded uint8 (N, C, H, W) tensor itself; batches are an `index_select`, then a
  preset's leading crop (photos: the random-resized crop and flip from the stored centre square,
  or the eval centre crop) runs on the device, rounded to uint8, and
  `ShardDataModule.on_after_batch_transfer` runs the rest of the ops.

Like every backend that hands over uint8 batches, it yields uint8 images at the output size
(built-in presets), never normalized floats (`MemoryLoader`).

On the CPU the NCHW store is the memory-mapped cache (RAM via the page cache, shared between
ranks); the padded store is a private copy (3.1 times the NCHW size for CIFAR). Samples skipped
as corrupt (`on_error="skip"`) keep their row and are left out of the batches that plan them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fastdata._util.pool import TensorPool
from fastdata._util.threads import one_thread_on_cpu
from fastdata.augment import Preset, pad_crop_params
from fastdata.format.fields import is_classification
from fastdata.format.manifest import SplitInfo
from fastdata.read.backends.memory_dict import frames_nbytes, make_resident_loader
from fastdata.read.base import BatchLoader, LoaderSpec, PlannedLoader
from fastdata.read.decoders.image import stored_hw
from fastdata.read.mix import map_row_labels
from fastdata.read.plan import PAD_LABEL, EpochPlan
from fastdata.read.source_ids import batch_keys, row_keys
from fastdata.read.stores.decoded_cache import ImageSize, cache_key, decode_split, decoded_nbytes
from fastdata.read.stores.padded import PaddedImages, padded_nbytes

__all__ = [
    "FusedPadCrop",
    "MemoryLoader",
    "clear_device_cache",
    "fused_pad_crop",
    "local_rank",
    "make_memory_loader",
    "resident_nbytes",
]

_COPY_CHUNK_BYTES = 256 << 20  # host -> device copies in chunks: no second full host copy
_DEVICE_STORE_SIZE = 4  # splits kept placed on a device in this process (train, val, test)


# ---------------------------------------------------------------- fused augmentation


@dataclass(frozen=True)
class FusedPadCrop:
    """A preset whose training ops the memory backend runs inside its gather.

    Attributes:
        preset: the preset (the DataModule normalizes the uint8 windows with it).
        pad: the pad-crop's padding.
        flip_p: the pad-crop's mirror probability.
    """

    preset: Preset
    pad: int
    flip_p: float


def fused_pad_crop(preset: Preset, train: bool, hw: tuple[int, int]) -> FusedPadCrop | None:
    """The fused plan of `preset` for images of size `hw`, or None when it does not apply.

    It applies when the preset's ops for the split are exactly one `PadCrop` (`Preset.pad_crop`)
    and the output keeps the stored size (the preset's `image_size`, when set, equals it).
    """
    op = preset.pad_crop(train)
    if op is None:
        return None
    if preset.image_size is not None and (preset.image_size, preset.image_size) != tuple(hw):
        return None  # the generic path raises the preset's size error
    return FusedPadCrop(preset, op.pad, op.flip_p)


def _store_layout(spec: LoaderSpec) -> tuple[tuple[int, int], FusedPadCrop | None]:
    margin = spec.preset.resizes(spec.train)
    hw = stored_hw(spec.manifest.split(spec.split), spec.image_size, margin)
    return hw, fused_pad_crop(spec.preset, spec.train, hw)


def resident_nbytes(
    info: SplitInfo, image_size: ImageSize, preset: Preset, train: bool = True
) -> int:
    """Device bytes of the memory backend's store of a split (padded when the preset fuses; a
    dict split's frames at their own size: `fastdata.read.backends.memory_dict.frames_nbytes`).

    Raises:
        ValueError: the split's images vary in size and the manifest does not say how large
            they are, or (classification) no `image_size` was given for them.
    """
    if not is_classification(info.field_specs):
        nbytes = frames_nbytes(info)
        if nbytes is None:
            raise ValueError(
                "the manifest records no image sizes (image_stats) for this split; re-run "
                "`fastdata shard` to record them"
            )
        return nbytes
    margin = preset.resizes(train)
    hw = stored_hw(info, image_size, margin)
    fused = fused_pad_crop(preset, train, hw)
    if fused is None:
        return decoded_nbytes(info, image_size, margin)
    # Decoded splits are always RGB (`fastdata.read.stores.decoded_cache`): 3 channels.
    return padded_nbytes(info.num_samples, 3, *hw, fused.pad, fused.flip_p > 0)


# ---------------------------------------------------------------- loader


class MemoryLoader(PlannedLoader):
    """Batches of one split on one rank, gathered from a device-resident store.

    Iterating yields the batches of the selected epoch's plan from the selected position, as
    (uint8 images (B, C, H, W), int64 labels (B,)) on the store's device, never normalized (the
    rule of every backend that hands over uint8 batches): from a `PaddedImages` store with a
    `fused` plan the pad-crop and flip are already applied (``applied_ops == 1``); from an NCHW
    store a preset's leading crop (`Preset.decode_crop`: random-resized crop and flip, or the
    eval centre crop) is applied on the device and rounded to uint8, as the cpu backend applies
    it while decoding (``applied_ops`` counts it), so both hand over images at the output size.
    `len` counts the batches taken before a resume, as every backend.

    Args:
        images: uint8 (N, C, H, W) store on the training device, or a `PaddedImages` store.
        labels: int64 (N,) labels, on the same device.
        spec: the loader spec (batch size, seed, epoch, rank, world size, train, preset).
        fused: the fused augmentation (required with a `PaddedImages` store).
        ok: bool (N,) rows decoded (False: skipped as corrupt); None: all.
    """

    normalized = False

    def __init__(
        self,
        images: torch.Tensor | PaddedImages,
        labels: torch.Tensor,
        spec: LoaderSpec,
        fused: FusedPadCrop | None = None,
        ok: torch.Tensor | None = None,
    ) -> None:
        if len(images) != len(labels) or len(images) == 0:
            raise ValueError(
                f"need as many labels as images (> 0), got {len(images)} and {len(labels)}"
            )
        if len(images) != sum(spec.shard_sizes):
            raise ValueError(
                f"the store has {len(images)} rows, the split {spec.split!r} "
                f"{sum(spec.shard_sizes)} samples"
            )
        if isinstance(images, PaddedImages) != (fused is not None):
            raise ValueError("a PaddedImages store needs a fused plan, and only it")
        if fused is not None and fused.pad != images.pad:
            raise ValueError(f"the store is padded by {images.pad}, the preset by {fused.pad}")
        self.images, self.labels, self.fused = images, labels, fused
        self.ok = None if ok is None or bool(ok.all()) else ok.to(labels.device)
        crop, _, covered = spec.preset.decode_crop(spec.train)
        self._crop_ops = spec.preset.ops(spec.train)[:covered] if crop is not None else ()
        if fused is not None:
            self._crop_ops = ()
        self.applied_ops = 1 if fused is not None else len(self._crop_ops)
        self._pool = TensorPool()  # CPU batches: reuse released memory instead of page-faulting
        self.device = labels.device
        self._keys: list[str] | None = None  # keys=True: every row's key, read once
        self.start_at(spec)

    @property
    def skipped(self) -> int:
        """Samples skipped under on_error='skip' (rows left out of every batch; each was logged
        with its shard and key when the split was decoded)."""
        return 0 if self.ok is None else int((~self.ok).sum())

    def _iterate(self, plan: EpochPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sizes = np.cumsum([0] + [len(r) for r in plan.rows])
        rows = torch.from_numpy(np.concatenate(plan.rows)).to(self.device)
        pads = None
        if not self.spec.train and any(p.any() for p in plan.padding):
            pads = torch.from_numpy(np.concatenate(plan.padding)).to(self.device)
        for b in range(len(plan.rows)):
            idx = rows[sizes[b] : sizes[b + 1]]
            pad = pads[sizes[b] : sizes[b + 1]] if pads is not None else None
            if self.ok is not None:
                keep = self.ok.index_select(0, idx)
                idx = idx[keep]
                pad = pad[keep] if pad is not None else None
            with one_thread_on_cpu(self.device):
                if self.fused is not None:
                    images = self.augment(idx, self.batch_generator(plan.seeds[b]))
                else:
                    images = self.images.index_select(0, idx)
                    if self._crop_ops:
                        images = self._crop(images, self.batch_generator(plan.seeds[b]))
                labels = self.labels.index_select(0, idx)
                if pad is not None:
                    labels = labels.masked_fill(pad, PAD_LABEL)
            if self.spec.keys:  # `fastdata.read.source_ids`
                padded = pad.tolist() if pad is not None else None
                yield images, labels, batch_keys(self._row_keys(), idx.tolist(), padded)
                continue
            yield images, labels

    def _row_keys(self) -> list[str]:
        if self._keys is None:
            self._keys = row_keys(self.spec)
        return self._keys

    def batch_generator(self, seed: int) -> torch.Generator:
        """A generator on the store's device, freshly seeded with a plan batch seed."""
        generator = getattr(self, "_generator", None)
        if generator is None:
            generator = self._generator = torch.Generator(device=self.device)
        return generator.manual_seed(seed)

    def augment(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The fused pad-crop and flip of the store's `rows` (a uint8 batch).

        Equals ``fused.preset.train_ops[0](images[rows], None, generator)``, so that
        ``preset.apply(batch, True, skip=1)`` equals ``preset.apply(images[rows], True,
        generator)``.
        """
        fused, store = self.fused, self.images
        assert fused is not None and isinstance(store, PaddedImages)
        offsets, flip = pad_crop_params(len(rows), fused.pad, generator, self.device, fused.flip_p)
        shape = (len(rows), store.channels, store.height, store.width)
        out = self._pool.empty(shape, torch.uint8, self.device, torch.contiguous_format)
        return store.windows(rows, offsets, flip, out=out)

    def _crop(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The preset's leading crop (and flip) of a batch, rounded to uint8 as a decoder would."""
        size = self.spec.preset.image_size
        x = images
        for op in self._crop_ops:
            x = op(x, size, generator)
        return x.round().clamp_(0, 255).to(torch.uint8) if x.is_floating_point() else x


# ---------------------------------------------------------------- placement

_Store = tuple[torch.Tensor | PaddedImages, torch.Tensor, torch.Tensor]
_DEVICE_STORE: OrderedDict[tuple[object, ...], _Store] = OrderedDict()


def clear_device_cache() -> None:
    """Drop the splits this process keeps placed on devices (frees their memory)."""
    _DEVICE_STORE.clear()


def _place(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor  # the memory-mapped cache: RAM via the page cache, shared between ranks
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    rows = max(1, _COPY_CHUNK_BYTES // max(1, tensor[0].numel() * tensor.element_size()))
    for start in range(0, len(tensor), rows):
        out[start : start + rows].copy_(tensor[start : start + rows])
    return out


def local_rank(rank: int) -> int:
    """This process's rank on its node: $LOCAL_RANK, else $SLURM_LOCALID, else `rank`.

    Only local rank 0 shows the decode progress bar: one bar per node, where each node decodes
    its own cache (or waits for the shared one).
    """
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return rank


def make_memory_loader(spec: LoaderSpec) -> BatchLoader:
    """The device-resident loader of `spec.split` (decoded once per cache, placed once per process)."""
    if not is_classification(spec.manifest.split(spec.split).field_specs):
        return make_resident_loader(spec)  # a dict dataset: every field resident
    device = torch.device(spec.device)
    hw, fused = _store_layout(spec)
    layout = ("padded", fused.pad, fused.flip_p > 0) if fused is not None else ("nchw",)
    key = (
        spec.manifest.root,
        cache_key(spec.manifest, spec.split, hw),
        spec.on_error,
        spec.verify_samples,
        str(device),
        layout,
    )
    if key not in _DEVICE_STORE:
        images, labels, _, ok = decode_split(
            spec.manifest,
            spec.split,
            spec.image_size,
            cache_dir=spec.decoded_cache_dir,
            on_error=spec.on_error,
            progress=None if local_rank(spec.rank) == 0 else False,
            margin=spec.preset.resizes(spec.train),
            verify_samples=spec.verify_samples,
        )
        if fused is not None:
            store = PaddedImages.build(images, fused.pad, device, mirrored=fused.flip_p > 0)
        else:
            store = _place(images, device)
        _DEVICE_STORE[key] = (store, _place(labels, device), ok)
        while len(_DEVICE_STORE) > _DEVICE_STORE_SIZE:
            _DEVICE_STORE.popitem(last=False)
    _DEVICE_STORE.move_to_end(key)
    store, labels, ok = _DEVICE_STORE[key]
    labels = map_row_labels(spec.manifest.split(spec.split), labels)  # a mix's merged classes
    return MemoryLoader(store, labels, spec, fused, ok)
