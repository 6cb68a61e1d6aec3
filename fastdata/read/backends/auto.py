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
2. When it does not fit and the training device is a GPU: among the registered backends that
   decode on the GPU (`fastdata.read.BACKENDS`: "dali", "nvjpeg"), are available here, can run
   the preset's ops (a user's callable needs uint8 batches) and carry the split's fields
   (`Backend.carries_fields`, for splits other than image + label), the fastest by measurement:
   with two or more, each is probed (`probe_rate`: a loader on the split, its steady images/s
   over a few batches after its start-up and prefetch, `fastdata.read.steady`; or recorded
   figures of this machine passed as `rate`), and a backend the probe shows slower is never
   chosen. What is installed decides nothing more: the first GPU run (H200, 2026-12-04) had DALI
   at 409 images/s and nvjpeg at 6,433 on the same photos. A backend whose probe fails is
   skipped, with its error in the reason. One candidate is taken without a probe.
3. "cpu" otherwise.

The probes are arguments so that tests (and callers that know better) can replace them; the
probe's rates are kept for the process (one probe per split, device and preset). The one log
line ("backend=auto chose ...") gives the choice, the figures and the measured rates. In DDP,
ranks can see different free memory: the caller should decide on rank 0 and broadcast the choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from fastdata.augment import BatchTransform, Preset, RandomResizedCrop
from fastdata.format.fields import is_classification
from fastdata.format.manifest import Manifest, SplitInfo
from fastdata.read import BACKENDS
from fastdata.read.backends.memory import resident_nbytes
from fastdata.read.decoders.image import stored_hw
from fastdata.read.stores.decoded_cache import ImageSize, decoded_nbytes

__all__ = ["backend_available", "choose_backend", "free_device_memory", "probe_rate"]

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
    rate: Callable[[str], float] | None = None,
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
        rate: images/s of the named GPU backend on this split here (recorded figures, or a
            probe); None: `probe_rate` on `split` (kept for the process). Asked only when two or
            more GPU backends can run; an exception skips that backend.

    Returns:
        (backend name, reason): a key of `fastdata.read.BACKENDS`.

    Raises:
        ValueError: `memory_share` out of range, or none of the splits is in the manifest.
    """
    if not 0.0 < memory_share <= 1.0:
        raise ValueError(f"memory_share must be in (0, 1], got {memory_share!r}")
    split = _deciding_split(manifest, split)
    info = manifest.split(split)
    free = free_memory(device)
    name, reason = _store_choice(
        info, split, device, free, memory_share, image_size, preset, ranks_per_node
    )
    if name is None and _is_gpu(device):
        if rate is None:
            rate = _cached_probe(manifest, split, device, image_size, preset)
        name, why = _gpu_decoder(preset, available, is_classification(info.field_specs), rate)
        reason = f"{reason}: it does not fit; " + why
    elif name is None:
        name, reason = "cpu", f"{reason}: it does not fit and {device} is not a GPU"
    _log.info("backend=auto chose %r: %s", name, reason)
    return name, reason


def _store_choice(
    info: SplitInfo,
    split: str,
    device: str,
    free: int,
    memory_share: float,
    image_size: ImageSize,
    preset: Preset,
    ranks_per_node: int,
) -> tuple[str | None, str]:
    """The choice when the memory backend's store of the split fits `memory_share` of `free`.

    Returns:
        (name, reason): "memory", or "cpu" where the cpu backend does the preset's crop better;
        name None when the store does not fit, the reason then the figures that say so.
    """
    size, need = _store_size(info, image_size, preset, _is_gpu(device), ranks_per_node)
    budget = int(free * memory_share)
    figures = (
        f"the memory backend's store of split {split!r} {size}; {memory_share:g} of the "
        f"{_human(free)} free on {device} is {_human(budget)}"
    )
    if need is None or need > budget:
        return None, figures
    # On the CPU the memory backend's epochs would run a random-resized crop of encoded images
    # in the training process (~11 ms an image at 224 px here, bench_loader --suites
    # memory-first); the cpu backend fuses it into decoding, in its workers.
    crop = isinstance(preset.decode_crop(True)[0], RandomResizedCrop)
    if not _is_gpu(device) and info.encoding != "raw" and crop:
        return "cpu", (
            f"{figures}: it fits, but on {device} the {preset.name!r} preset's random-resized "
            "crop would run in the training process; the cpu backend fuses it into decoding"
        )
    return "memory", f"{figures}: it fits"


def _is_gpu(device: str) -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:1") is a CUDA device."""
    return torch.device(device).type == "cuda"


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
    preset: Preset,
    available: Callable[[str], tuple[bool, str]],
    classification: bool,
    rate: Callable[[str], float],
) -> tuple[str, str]:
    """The fastest measured GPU-decoding backend (`BACKENDS`) that is available, can run
    `preset` and carry the split's fields, else "cpu" (and why)."""
    custom = any(isinstance(op, BatchTransform) for op in preset.train_ops + preset.eval_ops)
    missing, ready = [], []
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
            ready.append(backend.name)
        else:
            missing.append(f"{backend.name}: {why}")
    if len(ready) == 1:
        return ready[0], f"{ready[0]} decodes on the GPU instead (the one GPU decoder here)"
    rates: dict[str, float] = {}
    for name in ready:
        try:
            rates[name] = float(rate(name))
        except Exception as exc:  # noqa: BLE001 - a backend that fails its probe is not chosen
            missing.append(f"{name}: its probe failed ({type(exc).__name__}: {exc})")
    if rates:
        best = max(rates, key=lambda name: rates[name])  # ties: registration order
        measured = ", ".join(f"{name} {value:,.0f}" for name, value in rates.items())
        why = f"{best} decodes on the GPU instead, the fastest measured ({measured} images/s)"
        return best, why + ("" if not missing else " (not: " + "; ".join(missing) + ")")
    return "cpu", "no GPU decoder can run here (" + "; ".join(missing) + ")"


#: (manifest root, split, device, image size, preset) -> backend -> probed images/s.
_PROBED: dict[tuple[str, str, str, str, str], dict[str, float]] = {}


def _cached_probe(
    manifest: Manifest, split: str, device: str, image_size: ImageSize, preset: Preset
) -> Callable[[str], float]:
    key = (str(manifest.root), split, device, repr(image_size), preset.name)
    known = _PROBED.setdefault(key, {})

    def rate(name: str) -> float:
        if name not in known:
            known[name] = probe_rate(name, manifest, split, device, image_size, preset)
        return known[name]

    return rate


def probe_rate(
    name: str,
    manifest: Manifest,
    split: str,
    device: str,
    image_size: ImageSize,
    preset: Preset,
    *,
    batch_size: int = 64,
    warmup: int = 2,
    measure: int = 8,
    time_limit_s: float = 20.0,
) -> float:
    """Steady images/s of backend `name` reading the training side of `split` on `device`.

    A short probe (`fastdata.read.steady.steady_rate`): the loader's start-up (a pipeline build,
    the first batch), the two batches a GPU backend prefetches and `warmup` batches more are
    skipped, then `measure` batches timed, each made
    ready on the device (CUDA synchronized). The loader is closed after.

    Raises:
        RuntimeError: the split has too few batches for the probe, or it took over
            `time_limit_s` (a backend that slow is not worth choosing).
    """
    from fastdata.read import LoaderSpec
    from fastdata.read.steady import batch_images, steady_rate

    samples = manifest.split(split).num_samples
    spec = LoaderSpec(
        manifest=manifest, split=split, train=True, batch_size=min(batch_size, samples),
        preset=preset, image_size=image_size, device=device, drop_last=True,
    )  # fmt: skip
    loader = BACKENDS[name].load()(spec)
    dev = torch.device(device)
    deadline = time.monotonic() + time_limit_s

    def ready(batch: object) -> int:
        n = batch_images(batch)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {name} probe took over {time_limit_s:g} s")
        return n

    try:
        found = steady_rate(loader, backlog=2, warmup=warmup, measure=measure, ready=ready)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    if found.images_per_s is None:
        raise RuntimeError(f"split {split!r} is too small to probe {name}: {found.reason}")
    return found.images_per_s


def _human(nbytes: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
