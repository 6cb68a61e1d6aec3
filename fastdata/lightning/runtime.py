"""Where and how `ShardDataModule`'s loaders run: rank and world size, the training device, the
backend (named or chosen by `auto`) and the loader's workers (given or sized by `fastdata.tune`).

Each reads the Trainer when there is one (None without: Fabric, custom loops, benchmarks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import lightning.pytorch as pl
import torch

from fastdata.augment import Preset
from fastdata.format.manifest import Manifest
from fastdata.read import LoaderSpec, WorkerSettings, get_backend

log = logging.getLogger("fastdata")

if TYPE_CHECKING:
    from fastdata.tune.sizing import LoaderSettings

__all__ = [
    "auto_settings",
    "check_options",
    "pick_backend",
    "rank_and_world",
    "ranks_per_node",
    "size_workers",
    "training_device",
    "warn_unit_scale",
]


class DataModuleOptions(Protocol):
    """The `ShardDataModule` options `check_options` reads (the module itself has them)."""

    batch_size: int
    on_error: str
    rank: int | None
    world_size: int | None
    backend: str
    ignore_index: int
    workers: WorkerSettings


def check_options(options: DataModuleOptions) -> None:
    """ValueError naming the first `ShardDataModule` option that is out of range."""
    batch_size, on_error, backend = options.batch_size, options.on_error, options.backend
    rank, world_size, workers = options.rank, options.world_size, options.workers
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    counts = (("num_workers", 0), ("prefetch_factor", 0), ("decode_threads", 1))
    for name, least in counts:
        value = getattr(workers, name)
        if value != "auto" and (not isinstance(value, int) or value < least):
            raise ValueError(
                f"WorkerSettings.{name} must be an int >= {least} or 'auto', got {value!r}"
            )
    if (rank is None) != (world_size is None):
        raise ValueError(f"pass rank and world_size together, got {rank} and {world_size}")
    if world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got {rank} and {world_size}")
    if backend != "auto":
        get_backend(backend)  # a bad name fails here, with the choices
    if workers.timeout < 0:
        raise ValueError(f"WorkerSettings.timeout must be >= 0 seconds, got {workers.timeout!r}")
    ignore_index = options.ignore_index
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int in 0..65535, got {ignore_index!r}")
    if not 0 <= ignore_index <= 65535:  # masks are stored as uint16 at most
        raise ValueError(f"ignore_index must be in 0..65535, got {ignore_index}")


def rank_and_world(
    rank: int | None, world_size: int | None, trainer: pl.Trainer | None
) -> tuple[int, int]:
    """(rank, world size): the explicit ones, else the Trainer's, else torch.distributed's, else
    (0, 1)."""
    if world_size is not None and rank is not None:
        return rank, world_size
    if trainer is not None:
        return trainer.global_rank, trainer.world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def ranks_per_node(trainer: pl.Trainer) -> int:
    """Training processes sharing this machine: the Trainer's devices, or $LOCAL_WORLD_SIZE where
    a launcher set more. Under Ray Train each worker runs its own Trainer, of one device on a
    CPU (`devices="auto"`), while the node runs several workers; Ray Train and torchrun export
    their count per node as $LOCAL_WORLD_SIZE, which Lightning does not read."""
    return max(trainer.num_devices, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def training_device(trainer: pl.Trainer | None) -> torch.device:
    """The Trainer's root device, else the current CUDA device when there is one, else the CPU."""
    if trainer is not None:
        return trainer.strategy.root_device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_backend(
    backend: str,
    manifest: Manifest,
    splits: str | Sequence[str],
    image_size: int | None,
    preset: Preset,
    trainer: pl.Trainer | None,
) -> str:
    """The backend's name: `backend` when it can run here (else ValueError with the reason), or
    for "auto" `fastdata.read.backends.auto.choose_backend`'s choice from `splits` (the splits the module
    reads: the largest decides; rank 0's choice on every rank)."""
    if backend != "auto":
        ok, why = get_backend(backend).check()
        if not ok:
            raise ValueError(f"backend {backend!r} cannot run here: {why}")
        return backend
    from fastdata.read.backends.auto import choose_backend

    name, _reason = choose_backend(  # logs its choice and the figures behind it
        manifest,
        splits,
        str(training_device(trainer)),
        image_size,
        preset=preset,
        ranks_per_node=ranks_per_node(trainer) if trainer is not None else 1,
    )
    if trainer is not None and trainer.world_size > 1:
        # Free memory differs between ranks; all ranks must use rank 0's choice.
        name = trainer.strategy.broadcast(name, src=0)
    return name


def size_workers(
    spec: LoaderSpec,
    settings: WorkerSettings,
    backend: str,
    trainer: pl.Trainer | None,
) -> LoaderSpec:
    """`spec` with its workers: `settings`, its "auto" counts measured
    (`auto_settings`, which then also sets pinning; with
    ``decode_threads="auto"`` it times (workers, decode threads) pairs on photo splits).

    Workers persist between epochs whenever there are any: persistence follows the worker count
    used, never the tuner's verdict on another count (with ``num_workers=2`` and
    ``prefetch_factor="auto"`` the tuner may measure 0 workers best under a busy start-up)."""
    workers, prefetch = settings.num_workers, settings.prefetch_factor
    decode_threads = settings.decode_threads
    if "auto" in (workers, prefetch, decode_threads):
        # Ranks on one node share its cores; Lightning's launcher does not export that count.
        ranks = ranks_per_node(trainer) if trainer is not None else None
        auto = auto_settings(
            spec, backend=backend, ranks_per_node=ranks, decode_threads=decode_threads
        )
        workers = auto.num_workers if workers == "auto" else workers
        prefetch = auto.prefetch_factor if prefetch == "auto" else prefetch
        pin = settings.pin_memory  # a given one stands; persistence: the given, else the count's
        settings = replace(
            settings,
            pin_memory=auto.pin_memory if pin is None else pin,
            decode_threads=auto.decode_threads if decode_threads == "auto" else decode_threads,
        )
    settings = replace(settings, num_workers=int(workers), prefetch_factor=max(1, int(prefetch)))
    return replace(spec, workers=settings)


# `auto_settings`' choices in this process: (manifest root, split, backend, batch size,
# decode_threads) -> settings.
_AUTO_CACHE: dict[tuple[str, str, str, int, int | str], LoaderSettings] = {}


def auto_settings(
    spec: LoaderSpec,
    backend: str = "cpu",
    ranks_per_node: int | None = None,
    decode_threads: int | str = 1,
) -> LoaderSettings:
    """`fastdata.tune.tune` with the `QUICK` budget, cached: `ShardDataModule`'s "auto".

    Cached for this process per (manifest root, split, backend, batch size, decode_threads);
    `LoaderMonitor` re-checks the choice at every epoch end. pin_memory follows `spec.device`.
    With decode_threads "auto", photo splits time the decode-thread candidates (a few seconds:
    workers start for each); otherwise `decode_threads` is passed through.

    Args:
        spec: the loader's spec (its num_workers / prefetch_factor are ignored).
        backend: the backend the settings are for.
        ranks_per_node: training processes sharing this machine (see `fastdata.tune.tune`).
        decode_threads: threads per worker for photos, or "auto" to choose them by timing.

    Returns:
        The settings (a copy: callers may edit its reasons).
    """
    import fastdata.tune as tuning  # its names looked up at call time (tests replace them)

    key = (spec.manifest.root, spec.split, backend, spec.batch_size, decode_threads)
    if key not in _AUTO_CACHE:
        options = tuning.QUICK
        if decode_threads == "auto":
            options = replace(options, confirm="threads", confirm_batches=3)
        entry = get_backend(backend)
        probe = None  # a backend without loader workers measures nothing
        if entry.uses_workers or entry.name == "dali":  # DALI: its CPU thread count
            probe = replace(
                tuning.probe_system(tuning.QUICK.window_s),
                cuda_available=str(spec.device).startswith("cuda"),
            )
        chosen = tuning.tune(
            spec, backend, ranks_per_node=ranks_per_node, options=options, probe=probe
        ).settings
        if decode_threads != "auto":
            chosen = replace(chosen, decode_threads=int(decode_threads))
        _AUTO_CACHE[key] = chosen
    cached = _AUTO_CACHE[key]
    return replace(cached, reasons=list(cached.reasons))


def warn_unit_scale(mean: Sequence[float] | None, std: Sequence[float] | None) -> bool:
    """Warn (and return True) when the given statistics look like the 0..1 scale.

    fastdata normalizes uint8 pixels, so `mean`/`std` are on the 0..255 scale; torchvision's
    ImageNet numbers (0.485, ..., 0.229, ...) would give inputs up to ~1100. Looks like 0..1: every
    given value is at most 1 (std > 0). The warning names the values and their x255 equivalents.
    """
    given = {name: list(v) for name, v in (("mean", mean), ("std", std)) if v is not None}
    if not given or not all(v and all(abs(x) <= 1 for x in v) for v in given.values()):
        return False
    if "std" in given and min(given["std"]) <= 0:
        return False
    shown = ", ".join(f"{name}={v}" for name, v in given.items())
    scaled = ", ".join(f"{name}={[round(x * 255, 3) for x in v]}" for name, v in given.items())
    log.warning(
        "%s look like statistics on the 0..1 scale, but fastdata normalizes uint8 pixels on the "
        "0..255 scale (inputs would be ~255 times too large): pass %s (the values x255), or "
        "leave them None for the dataset's own",
        shown,
        scaled,
    )
    return True
