"""The device-resident backend: decode a split once, keep it on the training device as uint8.

airbench-style: the whole split lives on the device (`fastdata.read.decoded` decodes it once and
caches it on disk); every batch is a gather of a per-epoch permutation. Nothing is decoded per
epoch. Two store layouts:

- Fused pad-crop (training with a preset whose train ops are exactly one "pad_crop", i.e.
  "cifar"): the store is `fastdata.read.padded.PaddedImages`, pre-padded and mirrored, and the
  loader itself draws the crop offsets and flips (`fastdata.augment.pad_crop_params`), gathers the
  windows in one pass and normalizes with the preset: it yields augmented float batches
  (`augmented = True`). The result equals the preset's `apply` on the selected images with the
  same generator state (tested). The draws come from a generator seeded per batch from (seed,
  epoch, rank, batch), so a resumed epoch replays the same augmentation.
- Otherwise (evaluation, "photo_device", "none"): the decoded uint8 (N, C, H, W) tensor itself;
  batches are an `index_select`, and `ShardDataModule.on_after_batch_transfer` augments them on
  the device exactly as for the CPU backend.

On the CPU the NCHW store is the memory-mapped cache (RAM via the page cache, shared between
ranks); the padded store is a private copy (3.1 times the NCHW size for CIFAR).

Epoch order and ranks: a permutation of the split drawn from (seed, epoch) with a CPU
`torch.Generator` (identity for eval splits), padded by wrapping to `world_size * ceil(N /
world_size)` entries ("documented padding": the union over ranks is the whole split, a few samples
appear twice). Rank r takes the contiguous span `[r * span, (r + 1) * span)` (the rule of
`read/plan.py`), cut into batches; with `drop_last` (train only) the partial last batch is dropped,
so every rank yields exactly the same number of batches.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastdata._pool import TensorPool
from fastdata._threads import one_thread_on_cpu
from fastdata.augment import OPS, Preset, get_preset, normalize, pad_crop_params
from fastdata.manifest import SplitInfo
from fastdata.read.base import BatchLoader, LoaderSpec, check_start_batch
from fastdata.read.decoded import ImageSize, cache_key, decode_split, decoded_nbytes, stored_hw
from fastdata.read.padded import PaddedImages, padded_nbytes
from fastdata.read.plan import num_batches, rank_span

__all__ = [
    "FusedPadCrop",
    "MemoryLoader",
    "clear_device_cache",
    "epoch_permutation",
    "fused_pad_crop",
    "make_memory_loader",
    "resident_nbytes",
]

_COPY_CHUNK_BYTES = 256 << 20  # host -> device copies in chunks: no second full host copy
_DEVICE_STORE_SIZE = 4  # splits kept placed on a device in this process (train, val, test)


# ---------------------------------------------------------------- epoch order


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Row order of one epoch (int64, CPU): a permutation drawn from (seed, epoch), or 0..n-1."""
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    generator = torch.Generator().manual_seed(_seed("fastdata-memory", seed, epoch))
    return torch.randperm(n, generator=generator)


# ---------------------------------------------------------------- fused augmentation


@dataclass(frozen=True)
class FusedPadCrop:
    """A preset whose training ops the memory backend runs inside its gather.

    Attributes:
        preset: the preset (its mean, std, dtype and memory format normalize the batch).
        pad: the pad-crop's padding.
        flip_p: the pad-crop's mirror probability.
    """

    preset: Preset
    pad: int
    flip_p: float


def fused_pad_crop(preset: Preset, train: bool, hw: tuple[int, int]) -> FusedPadCrop | None:
    """The fused plan of `preset` for images of size `hw`, or None when it does not apply.

    It applies to training when the preset's train ops are exactly one "pad_crop" and the output
    keeps the stored size (the preset's `image_size`, when set, equals it).
    """
    ops = preset.train_ops
    if not train or len(ops) != 1 or ops[0].name != "pad_crop":
        return None
    if preset.image_size is not None and (preset.image_size, preset.image_size) != tuple(hw):
        return None  # the generic path raises the preset's size error
    defaults = {
        name: p.default
        for name, p in inspect.signature(OPS["pad_crop"]).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    params = {**defaults, **dict(ops[0].params)}
    return FusedPadCrop(preset, int(params["pad"]), float(params["flip_p"]))


def _store_layout(spec: LoaderSpec) -> tuple[tuple[int, int], FusedPadCrop | None]:
    hw = stored_hw(spec.manifest.split(spec.split), spec.image_size)
    return hw, fused_pad_crop(get_preset(spec.preset, spec.image_size), spec.train, hw)


def resident_nbytes(
    info: SplitInfo, image_size: ImageSize, preset: str = "none", train: bool = True
) -> int:
    """Device bytes of the memory backend's store of a split (padded when the preset fuses)."""
    hw = stored_hw(info, image_size)
    fused = fused_pad_crop(get_preset(preset, image_size), train, hw)
    if fused is None:
        return decoded_nbytes(info, image_size)
    # Decoded splits are always RGB (`fastdata.read.decoded`): 3 channels.
    return padded_nbytes(info.num_samples, 3, *hw, fused.pad, fused.flip_p > 0)


# ---------------------------------------------------------------- loader


class MemoryLoader:
    """Batches of one split on one rank, gathered from a device-resident store.

    Iterating yields batches of (images, int64 labels (B,)) on the store's device: batches
    `start_batch` to `len(self) - 1` of the epoch. Images are uint8 (B, C, H, W) from an NCHW
    store, or augmented, normalized float batches from a `PaddedImages` store with a `fused` plan
    (then `augmented` is True). `len` is the whole epoch also when resuming, as for the CPU
    backend (Lightning counts the restored batches towards it). `set_epoch` selects the epoch and
    resume position; a completed pass clears `start_batch`.

    Args:
        images: uint8 (N, C, H, W) store on the training device, or a `PaddedImages` store.
        labels: int64 (N,) labels, on the same device.
        spec: the loader spec (batch size, seed, epoch, rank, world size, start_batch, train).
        fused: the fused augmentation (required with a `PaddedImages` store).
    """

    def __init__(
        self,
        images: torch.Tensor | PaddedImages,
        labels: torch.Tensor,
        spec: LoaderSpec,
        fused: FusedPadCrop | None = None,
    ) -> None:
        if spec.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {spec.batch_size}")
        if len(images) != len(labels) or len(images) == 0:
            raise ValueError(
                f"need as many labels as images (> 0), got {len(images)} and {len(labels)}"
            )
        if isinstance(images, PaddedImages) != (fused is not None):
            raise ValueError("a PaddedImages store needs a fused plan, and only it")
        if fused is not None and fused.pad != images.pad:
            raise ValueError(f"the store is padded by {images.pad}, the preset by {fused.pad}")
        if not 0 <= spec.rank < spec.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {spec.rank} and {spec.world_size}")
        self.images, self.labels, self.spec, self.fused = images, labels, spec, fused
        self.augmented = fused is not None
        self._pool = TensorPool()  # CPU batches: reuse released memory instead of page-faulting
        self.device = labels.device
        drop = spec.drop_last and spec.train  # eval splits: every sample, no drop
        self.total_batches = num_batches(len(images), spec.world_size, spec.batch_size, drop)
        self.set_epoch(spec.epoch, spec.start_batch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select epoch `epoch`'s order, skipping its first `start_batch` batches (resume)."""
        self.epoch, self.start_batch = epoch, check_start_batch(start_batch, self.total_batches)

    def __len__(self) -> int:
        """Batches per rank per epoch (the full epoch, also when resuming mid-epoch)."""
        return self.total_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        spec, bs = self.spec, self.spec.batch_size
        order = epoch_permutation(len(self.images), spec.seed, self.epoch, shuffle=spec.train)
        span = rank_span(order.numpy(), spec.rank, spec.world_size)
        rows = torch.from_numpy(span).to(self.device)
        for b in range(self.start_batch, self.total_batches):
            idx = rows[b * bs : (b + 1) * bs]
            with one_thread_on_cpu(self.device):
                if self.fused is None:
                    images = self.images.index_select(0, idx)
                else:
                    images = self.augment(idx, self.batch_generator(b))
                batch = images, self.labels.index_select(0, idx)
            yield batch
        self.start_batch = 0

    def batch_generator(self, batch: int) -> torch.Generator:
        """The generator of batch `batch` of this epoch and rank, freshly seeded."""
        generator = getattr(self, "_generator", None)
        if generator is None:
            generator = self._generator = torch.Generator(device=self.device)
        spec = self.spec
        return generator.manual_seed(
            _seed("fastdata-augment", spec.seed, self.epoch, spec.rank, batch)
        )

    def augment(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The fused pad-crop, flip and normalization of the store's `rows` (a float batch).

        Equals ``fused.preset.apply(images[rows], train=True, generator=generator)``.
        """
        fused, store = self.fused, self.images
        assert fused is not None and isinstance(store, PaddedImages)
        offsets, flip = pad_crop_params(len(rows), fused.pad, generator, self.device, fused.flip_p)
        shape = (len(rows), store.channels, store.height, store.width)
        buffer = getattr(self, "_buffer", None)
        if buffer is None or buffer.shape != shape:  # reused: never handed out (normalize copies)
            buffer = self._buffer = torch.empty(shape, dtype=torch.uint8, device=self.device)
        windows = store.windows(rows, offsets, flip, out=buffer)
        preset = fused.preset
        fmt = torch.channels_last if preset.channels_last else torch.contiguous_format
        out = self._pool.empty(shape, preset.dtype, self.device, fmt)
        return normalize(windows, preset.mean, preset.std, preset.dtype, preset.channels_last, out)


# ---------------------------------------------------------------- placement

_Store = tuple[torch.Tensor | PaddedImages, torch.Tensor]
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


def make_memory_loader(spec: LoaderSpec) -> BatchLoader:
    """The device-resident loader of `spec.split` (decoded once per cache, placed once per process)."""
    device = torch.device(spec.device)
    hw, fused = _store_layout(spec)
    layout = ("padded", fused.pad, fused.flip_p > 0) if fused is not None else ("nchw",)
    key = (
        spec.manifest.root,
        cache_key(spec.manifest, spec.split, hw),
        spec.on_error,
        str(device),
        layout,
    )
    if key not in _DEVICE_STORE:
        images, labels, _ = decode_split(
            spec.manifest, spec.split, spec.image_size, on_error=spec.on_error
        )
        if fused is not None:
            store = PaddedImages.build(images, fused.pad, device, mirrored=fused.flip_p > 0)
        else:
            store = _place(images, device)
        _DEVICE_STORE[key] = (store, _place(labels, device))
        while len(_DEVICE_STORE) > _DEVICE_STORE_SIZE:
            _DEVICE_STORE.popitem(last=False)
    _DEVICE_STORE.move_to_end(key)
    return MemoryLoader(*_DEVICE_STORE[key], spec, fused)
