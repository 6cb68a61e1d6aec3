"""Pieces of `gpu_check.py`: the data it shards (real or synthetic) and the timed loader runs.

Every loader run goes through the public DataModule API (``ShardDataModule(...)``, ``setup``,
``train_dataloader``, ``transfer_batch_to_device``, ``on_after_batch_transfer``), so this file
does not depend on the read backends' internal contract.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.format.manifest import Manifest
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from fastdata.write.sources.arrays import ArraySource

__all__ = [
    "Dataset",
    "MemoryProbe",
    "RunSettings",
    "loader_run",
    "nvjpeg_run",
    "shard_dataset",
    "synthetic_cifar",
    "synthetic_photos",
]

MiB = 2**20


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Dataset:
    """Shards written for the check, and where they came from (for the report)."""

    name: str
    root: Path
    source: str  # "real: PATH" or "synthetic (...)"
    samples: dict[str, int]
    seconds: float

    @property
    def real(self) -> bool:
        return self.source.startswith("real")

    def row(self) -> dict[str, Any]:
        """The report's figures of this dataset."""
        return {"source": self.source, "samples": self.samples, "shard_s": round(self.seconds, 2)}


class _FirstN:
    """The first `limit` samples of every split of a source (itself a `Source`)."""

    def __init__(self, source: Any, limit: int | None) -> None:
        self.source, self.limit = source, limit
        self.kind, self.classes = source.kind, source.classes

    def splits(self) -> dict[str, int]:
        sizes = self.source.splits()
        return {k: min(v, self.limit) if self.limit else v for k, v in sizes.items()}

    def item(self, split: str, index: int) -> Any:
        return self.source.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        return {**self.source.fingerprint(), "first_n": self.limit}


def synthetic_photos(folder: Path, per_class: int, classes: int = 10) -> Path:
    """A class-per-folder tree of JPEGs of mixed sizes (smooth noise), like clothing-small."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (folder / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = int(rng.integers(240, 480)), int(rng.integers(240, 480))
            small = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
            image = Image.fromarray(small).resize((w, h), Image.BILINEAR)
            image.save(folder / f"class{c:02d}" / f"{i:04d}.jpg", "JPEG", quality=90)
    return folder


def synthetic_cifar(train: int, test: int) -> ArraySource:
    """Random 32 x 32 images with 100 classes, CIFAR-100's layout (raw uint8 pixels)."""
    rng = np.random.default_rng(0)
    splits = {
        name: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 100, n))
        for name, n in (("train", train), ("test", test))
    }
    return ArraySource(splits, [f"class{i}" for i in range(100)], kind="synthetic-cifar100")


def shard_dataset(
    name: str, source: Any, origin: str, out: Path, limit: int | None, max_count: int
) -> Dataset:
    """Write `source` (its first `limit` samples per split) as shards in `out`.

    The writer forks its worker processes: after CUDA was initialized in this process that is
    unsafe, so it then writes in this process only.
    """
    workers = 1 if torch.cuda.is_initialized() else min(8, os.cpu_count() or 1)
    t0 = time.perf_counter()
    options = ShardOptions(max_count=max_count, workers=workers, progress=False)
    manifest: Manifest = write_shards(_FirstN(source, limit), out, options)
    samples = {k: v.num_samples for k, v in manifest.splits.items()}
    return Dataset(name, Path(manifest.root), origin, samples, time.perf_counter() - t0)


def open_real(kind: str, path: Path) -> Any:
    """The real dataset at `path` (FileNotFoundError naming it when absent)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (set FASTDATA_DATA_DIR or --data-dir)")
    return open_source(kind, path)


# ---------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryProbe:
    """GPU memory during a run, each figure labelled for what it measures.

    - ``torch_peak_alloc_mib``: torch's caching allocator's peak; DALI's outputs are DLPack views
      of DALI's own pools, so for DALI it reads about 0;
    - ``device_used_delta_mib``: device-wide used memory (NVML, else cudaMemGetInfo) above the
      level before the run: every allocator of this process (DALI's pools, nvJPEG's buffers);
    - ``device_used_after_close_mib``: the same after the loader was closed, the DataModule
      dropped, garbage collected and torch's cache emptied: what the run leaves behind.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[float] = []
        self.after_close: float | None = None
        self.base = 0
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = self.used()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def sample(self, closed: bool = False) -> None:
        if self.device.type != "cuda":
            return
        sync(self.device)
        delta = (self.used() - self.base) / MiB
        if closed:
            self.after_close = delta
        else:
            self.samples.append(delta)

    def result(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {
            "torch_peak_alloc_mib": round(torch.cuda.max_memory_allocated(self.device) / MiB, 1),
            "device_used_delta_mib": round(max(self.samples, default=0.0), 1),
            "device_used_after_epoch_mib": [round(s, 1) for s in self.samples],
            "device_used_after_close_mib": (
                None if self.after_close is None else round(self.after_close, 1)
            ),
        }


@dataclass(frozen=True)
class RunSettings:
    """One loader run: the DataModule's arguments and how long to time it."""

    batch_size: int
    preset: str
    image_size: int | None
    workers: int
    epochs: int
    warmup: int
    deadline: float  # time.monotonic() after which no further epoch starts
    loader_timeout_s: float


def _datamodule(root: Path, backend: str, s: RunSettings) -> Any:
    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.read import WorkerSettings

    # A loader timeout and a safe worker start method; the prefetch depth measured.
    workers = WorkerSettings(
        num_workers=s.workers,
        prefetch_factor="auto",
        timeout=s.loader_timeout_s,
        mp_context="forkserver",
    )
    return ShardDataModule(
        root, batch_size=s.batch_size, backend=backend, train_transforms=s.preset,
        image_size=s.image_size, seed=0, drop_last=True, workers=workers,
    )  # fmt: skip


def loader_run(
    backend: str, root: Path, device: torch.device, s: RunSettings, energy: Callable | None
) -> dict[str, Any]:
    """Images/s of `backend` on the train split, until augmented batches are on `device`."""
    probe = MemoryProbe(device)
    t0 = time.perf_counter()
    dm = _datamodule(root, backend, s)
    dm.setup("fit")
    loader = dm.train_dataloader()
    result: dict[str, Any] = {"setup_s": round(time.perf_counter() - t0, 3)}

    def ready(batch: Any) -> torch.Tensor:
        return dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)[0]

    joules0 = energy() if energy else None
    result.update(time_epochs(loader, ready, device, s, probe))
    joules1 = energy() if energy else None
    if joules0 is not None and joules1 is not None and result["images"]:
        result["energy_j_per_1k_images"] = round(1e3 * (joules1 - joules0) / result["images"], 3)
    _release(loader, dm, device)
    loader = dm = None  # the last references: the store and pools can go
    _collect(device)
    probe.sample(closed=True)
    result.update(probe.result())
    return result


#: Fewer batches an epoch than this and the rate after the first batch is the prefetched backlog.
STEADY_MIN_BATCHES = 24


def time_epochs(
    loader: Any, ready: Callable[[Any], torch.Tensor], device: torch.device, s: RunSettings,
    probe: MemoryProbe,
) -> dict[str, Any]:  # fmt: skip
    """Iterate `warmup + epochs` epochs (fewer past the deadline); images/s of the timed ones.

    The DataModule's loader advances the epoch itself each time it is iterated. CUDA is
    synchronized at the start and end of every epoch and after its first batch, so "steady"
    excludes the pipeline's start-up. An epoch of fewer than `STEADY_MIN_BATCHES` batches has no
    steady rate: loader workers decode the batches after the first while the first is awaited
    (the H200 run of 2026-12-04 reported 200,595 "steady" images/s for the cpu backend on six
    128-photo batches), so "steady" is None there and says why.
    """
    timed, epochs_run = [], 0
    for epoch in range(s.warmup + s.epochs):
        if epoch > 0 and time.monotonic() > s.deadline:
            break
        sync(device)
        t0 = time.perf_counter()
        images = first_images = 0
        first_s = None
        for batch in loader:
            n = ready(batch).shape[0]
            images += n
            if first_s is None:
                sync(device)
                first_s, first_images = time.perf_counter() - t0, n
        sync(device)
        probe.sample()
        epochs_run += 1
        if epoch >= s.warmup:
            timed.append((images, time.perf_counter() - t0, first_s or 0.0, first_images))
    if not timed:  # the deadline came after the warm-up: time the warm-up epoch instead
        timed.append((images, time.perf_counter() - t0, first_s or 0.0, first_images))
    n, secs = sum(t[0] for t in timed), sum(t[1] for t in timed)
    steady_n, steady_s = n - sum(t[3] for t in timed), secs - sum(t[2] for t in timed)
    batches = timed[0][0] / max(timed[0][3], 1)  # per epoch, from the first batch's size
    steady = round(steady_n / steady_s, 1) if steady_s > 0 else None
    if batches < STEADY_MIN_BATCHES:
        steady = None
    return {
        "epochs_run": epochs_run,
        "images": n,
        "images_per_s": round(n / secs, 1) if secs else None,
        "steady_images_per_s": steady,
        "steady_note": None
        if steady is not None or batches >= STEADY_MIN_BATCHES
        else f"{batches:.0f} batches an epoch: too few for a steady rate (workers prefetch)",
        "epoch_s": [round(t[1], 3) for t in timed],
        "first_batch_s": [round(t[2], 3) for t in timed],
    }


def nvjpeg_run(
    root: Path, device: torch.device, s: RunSettings, energy: Callable | None
) -> dict[str, Any]:
    """The nvjpeg backend before it is registered: its loader built from the DataModule's spec
    (`ShardDataModule.loader_spec`), the DataModule's device augmentation after it."""
    from fastdata.read.backends.nvjpeg import make_nvjpeg_loader

    probe = MemoryProbe(device)
    t0 = time.perf_counter()
    dm = _datamodule(root, "cpu", s)
    dm.setup("fit")
    loader = make_nvjpeg_loader(dm.loader_spec("train", True))
    result: dict[str, Any] = {"setup_s": round(time.perf_counter() - t0, 3), "via": "loader_spec"}

    def ready(batch: Any) -> torch.Tensor:
        return dm.on_after_batch_transfer(batch, 0)[0]

    joules0 = energy() if energy else None
    result.update(time_epochs(loader, ready, device, s, probe))
    joules1 = energy() if energy else None
    if joules0 is not None and joules1 is not None and result["images"]:
        result["energy_j_per_1k_images"] = round(1e3 * (joules1 - joules0) / result["images"], 3)
    loader = dm = None  # the last references: the store and pools can go
    _collect(device)
    probe.sample(closed=True)
    result.update(probe.result())
    return result


def _release(loader: Any, dm: Any, device: torch.device) -> None:
    """Close what the loader holds (DALI pipelines, worker processes, resident stores)."""
    for obj in (loader, getattr(loader, "loader", None), getattr(loader, "_loader", None)):
        if obj is not None and hasattr(obj, "close"):
            obj.close()
    # The DataModule keeps its loaders (one per role, for resize_workers): stop and drop them,
    # or the store stays.
    if dm is not None:
        dm.teardown()
        dm._loaders.clear()


def _collect(device: torch.device) -> None:
    try:
        from fastdata.read.backends import memory

        if hasattr(memory, "clear_device_cache"):
            memory.clear_device_cache()
    except ImportError:
        pass
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
