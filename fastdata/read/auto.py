"""`backend="auto"`: pick the read backend from the size of the decoded split and the hardware.

Rule, in order:

1. "memory" when the memory backend's store of the split (`fastdata.read.memory.resident_nbytes`:
   N x 3 x H x W uint8 at the stored size of `fastdata.read.decoded.stored_hw`, or the padded and
   mirrored layout of a preset with a fused pad-crop, 3.1x that for CIFAR) fits `memory_share` of
   the free memory of the training device (`torch.cuda.mem_get_info` on a GPU,
   `psutil.virtual_memory().available` on the CPU): nothing is decoded after the first epoch, and
   batches are one gather on the device.
2. "dali" when it does not fit, the training device is a GPU and DALI is importable: decoding on
   the GPU keeps up with the model where CPU workers would not.
3. "cpu" otherwise.

The probes are arguments so that tests (and callers that know better) can replace them. In DDP,
ranks can see different free memory: the caller should decide on rank 0 and broadcast the choice.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from fastdata.manifest import Manifest
from fastdata.read.decoded import ImageSize, decoded_nbytes, stored_hw
from fastdata.read.memory import resident_nbytes

__all__ = ["choose_backend", "dali_importable", "free_device_memory"]

_log = logging.getLogger("fastdata")


def dali_importable() -> bool:
    """True when `nvidia.dali` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # no `nvidia` namespace package at all
        return False


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
    split: str,
    device: str,
    image_size: ImageSize,
    *,
    preset: str = "none",
    ranks_per_node: int = 1,
    memory_share: float = 0.5,
    dali_available: Callable[[], bool] = dali_importable,
    free_memory: Callable[[str], int] = free_device_memory,
) -> tuple[str, str]:
    """The backend for `split` on `device`, and the reason (with the figures) for the choice.

    Args:
        manifest: the shard folder's manifest.
        split: the split that decides (the training split: the largest).
        device: the training device ("cpu", "cuda", "cuda:1").
        image_size: output size of variable-size photos (as for the memory backend).
        preset: the augmentation preset's name (it decides the memory backend's store layout).
        ranks_per_node: training processes on this machine. On the CPU they share the plain
            store (one memory-mapped cache) but each builds its own padded store, so a padded
            store is counted once per rank.
        memory_share: the fraction of the free device memory the decoded split may take.
        dali_available: probe: can DALI be imported?
        free_memory: probe: free bytes on a device.

    Returns:
        (backend name, reason): the name is "memory", "dali" or "cpu".
    """
    if not 0.0 < memory_share <= 1.0:
        raise ValueError(f"memory_share must be in (0, 1], got {memory_share!r}")
    info = manifest.split(split)
    on_gpu = torch.device(device).type == "cuda"
    free = free_memory(device)
    budget = int(free * memory_share)
    try:
        h, w = stored_hw(info, image_size)
    except ValueError as exc:  # photos of varying size and no image_size: no fixed-size store
        size, need = f"cannot be sized ({exc})", None
    else:
        need = resident_nbytes(info, image_size, preset)
        size = f"takes {_human(need)} ({info.num_samples} images of {h}x{w}, {preset!r} preset)"
        private = need != decoded_nbytes(info, image_size)  # the padded layout: a copy per rank
        if not on_gpu and private and ranks_per_node > 1:
            need *= ranks_per_node
            size += f", x{ranks_per_node} ranks on this machine = {_human(need)}"
    figures = (
        f"the memory backend's store of split {split!r} {size}; {memory_share:g} of the {_human(free)} free on "
        f"{device} is {_human(budget)}"
    )
    if need is not None and need <= budget:
        name, reason = "memory", f"{figures}: it fits"
    elif on_gpu and dali_available():
        name, reason = "dali", f"{figures}: it does not fit; DALI decodes on the GPU instead"
    elif on_gpu:
        name, reason = (
            "cpu",
            f"{figures}: it does not fit and DALI is not installed (fastdata[dali])",
        )
    else:
        name, reason = "cpu", f"{figures}: it does not fit and {device} is not a GPU (no DALI)"
    _log.info("backend=auto chose %r: %s", name, reason)
    return name, reason


def _human(nbytes: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
