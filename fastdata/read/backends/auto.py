"""`backend="auto"`: pick the read backend from the size of the decoded split and the hardware.

Rule, in order:

The split that decides is the largest of those the caller will read (`ShardDataModule`: every
split it resolved, the training split when there is one; a val-only dataset: its val split).

1. "memory" when the memory backend's store of the split (`fastdata.read.backends.memory.resident_nbytes`:
   N x 3 x H x W uint8 at the stored size of `fastdata.read.decoders.image.stored_hw`, or the padded and
   mirrored layout of a preset with a fused pad-crop, 3.1x that for CIFAR; a dict split's frames
   at their own size, `fastdata.read.backends.memory_dict.frames_nbytes`) fits `memory_share` of
   the free memory of the training device (`torch.cuda.mem_get_info` on a GPU,
   `psutil.virtual_memory().available` on the CPU): nothing is decoded after the first epoch, and
   batches are one gather on the device.
2. When it does not fit and the training device is a GPU: the first registered backend
   (`fastdata.read.BACKENDS`, in order: "dali", then "nvjpeg") that decodes on the GPU, is
   available here, can run the preset's ops (a user's callable needs uint8 batches) and carries
   the split's fields (`Backend.carries_fields`, for splits other than image + label): decoding
   on the GPU keeps up with the model where CPU workers would not.
3. "cpu" otherwise.

The probes are arguments so that tests (and callers that know better) can replace them. In DDP,
ranks can see different free memory: the caller should decide on rank 0 and broadcast the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from fastdata.augment import BatchTransform, Preset, RandomResizedCrop
from fastdata.format.fields import is_classification
from fastdata.format.manifest import Manifest, SplitInfo
from fastdata.read import BACKENDS
from fastdata.read.backends.memory import resident_nbytes
from fastdata.read.decoders.image import stored_hw
from fastdata.read.stores.decoded_cache import ImageSize, decoded_nbytes

__all__ = ["backend_available", "choose_backend", "free_device_memory"]

_log = logging.getLogger("fastdata")


def backend_available(name: str) -> tuple[bool, str]:
    """(the registered backend `name` can run here, reason when not)."""
    return BACKENDS[name].check()


def free_device_memory(device: str) -> int:
    """Free bytes on `device`: the GPU's free memory, or the host's available RAM for "cpu"."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    import psutil  # a dependency of fastdata; only the CPU probe needs it

    return int(psutil.virtual_memory().available)


def choose_backend(
    manifest: Manifest,
    split: str | Sequence[str],
    device: str,
    image_size: ImageSize,
    *,
    preset: Preset,
    ranks_per_node: int = 1,
    memory_share: float = 0.5,
    available: Callable[[str], tuple[bool, str]] = backend_available,
    free_memory: Callable[[str], int] = free_device_memory,
) -> tuple[str, str]:
    """The backend for `split` on `device`, and the reason (with the figures) for the choice.

    Args:
        manifest: the shard folder's manifest.
        split: the split that decides, or the splits the caller will read: the one with the
            most samples decides (the first on a tie); names not in the manifest are ignored.
        device: the training device ("cpu", "cuda", "cuda:1").
        image_size: output size of variable-size photos (as for the memory backend).
        preset: the augmentation preset (it decides the memory backend's store layout, and
            whether a GPU backend that fuses its graph can run it).
        ranks_per_node: training processes on this machine. On the CPU they share the plain
            store (one memory-mapped cache) but each builds its own padded store, so a padded
            store is counted once per rank.
        memory_share: the fraction of the free device memory the decoded split may take.
        available: probe: (can the named backend run here, reason when not).
        free_memory: probe: free bytes on a device.

    Returns:
        (backend name, reason): a key of `fastdata.read.BACKENDS`.

    Raises:
        ValueError: `memory_share` out of range, or none of the splits is in the manifest.
    """
    if not 0.0 < memory_share <= 1.0:
        raise ValueError(f"memory_share must be in (0, 1], got {memory_share!r}")
    split = _deciding_split(manifest, split)
    info = manifest.split(split)
    on_gpu = torch.device(device).type == "cuda"
    free = free_memory(device)
    budget = int(free * memory_share)
    size, need = _store_size(info, image_size, preset, on_gpu, ranks_per_node)
    figures = (
        f"the memory backend's store of split {split!r} {size}; {memory_share:g} of the {_human(free)} free on "
        f"{device} is {_human(budget)}"
    )
    # On the CPU the memory backend's epochs would run a random-resized crop of encoded images
    # in the training process (~11 ms an image at 224 px here, bench_loader --suites
    # memory-first); the cpu backend fuses it into decoding, in its workers.
    crop_in_trainer = (
        not on_gpu
        and info.encoding != "raw"
        and isinstance(preset.decode_crop(True)[0], RandomResizedCrop)
    )
    if need is not None and need <= budget and crop_in_trainer:
        name = "cpu"
        reason = (
            f"{figures}: it fits, but on {device} the {preset.name!r} preset's random-resized "
            "crop would run in the training process; the cpu backend fuses it into decoding"
        )
    elif need is not None and need <= budget:
        name, reason = "memory", f"{figures}: it fits"
    elif on_gpu:
        name, why = _gpu_decoder(preset, available, is_classification(info.field_specs))
        reason = f"{figures}: it does not fit; " + why
    else:
        name, reason = "cpu", f"{figures}: it does not fit and {device} is not a GPU"
    _log.info("backend=auto chose %r: %s", name, reason)
    return name, reason


def _deciding_split(manifest: Manifest, splits: str | Sequence[str]) -> str:
    """The split with the most samples among `splits` in the manifest (ValueError: none is)."""
    names = [splits] if isinstance(splits, str) else list(splits)
    present = [name for name in names if name in manifest.splits]
    if not present:
        raise ValueError(
            f"backend='auto' decides on the splits to read, {names}, but none is in the manifest "
            f"at {manifest.root} (it has {sorted(manifest.splits)}); pass splits={{...}} naming "
            "its splits, or a backend by name"
        )
    return max(present, key=lambda name: manifest.split(name).num_samples)


def _store_size(
    info: SplitInfo, image_size: ImageSize, preset: Preset, on_gpu: bool, ranks_per_node: int
) -> tuple[str, int | None]:
    """(what the memory backend's store of the split takes, in words; its bytes or None)."""
    if not is_classification(info.field_specs):  # a dict split: frames at their own size
        try:
            need = resident_nbytes(info, image_size, preset)
        except ValueError as exc:
            return f"cannot be sized ({exc})", None
        return (
            f"takes {_human(need)} ({info.num_samples} samples at their own size, "
            f"{preset.name!r} preset)"
        ), need
    try:
        h, w = stored_hw(info, image_size, preset.resizes(True))
    except ValueError as exc:  # photos of varying size and no image_size: no fixed-size store
        return f"cannot be sized ({exc})", None
    need = resident_nbytes(info, image_size, preset)
    size = f"takes {_human(need)} ({info.num_samples} images of {h}x{w}, {preset.name!r} preset)"
    # the padded layout: a copy per rank
    private = need != decoded_nbytes(info, image_size, preset.resizes(True))
    if not on_gpu and private and ranks_per_node > 1:
        need *= ranks_per_node
        size += f", x{ranks_per_node} ranks on this machine = {_human(need)}"
    return size, need


def _gpu_decoder(
    preset: Preset, available: Callable[[str], tuple[bool, str]], classification: bool = True
) -> tuple[str, str]:
    """The first available GPU-decoding backend (`BACKENDS`, in order) that can run `preset` and
    carry the split's fields, else "cpu" (and why)."""
    custom = any(isinstance(op, BatchTransform) for op in preset.train_ops + preset.eval_ops)
    missing = []
    for backend in BACKENDS.values():
        if not backend.decodes_on_gpu:
            continue
        if custom and not backend.user_transforms:
            missing.append(f"{backend.name}: cannot run a user transform")
            continue
        if not classification and not backend.carries_fields:
            missing.append(f"{backend.name}: carries only an image and a label")
            continue
        ok, why = available(backend.name)
        if ok:
            return backend.name, f"{backend.name} decodes on the GPU instead"
        missing.append(f"{backend.name}: {why}")
    return "cpu", "no GPU decoder can run here (" + "; ".join(missing) + ")"


def _human(nbytes: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
