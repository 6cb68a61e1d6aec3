"""Pieces of `gpu_check.py`: the data it shards (real or synthetic) and the timed loader runs.

Every loader run goes through the public DataModule API (``ShardDataModule(...)``, ``setup``,
``train_dataloader``, ``transfer_batch_to_device``, ``on_after_batch_transfer``), so this file
does not depend on the read backends' internal contract.
"""

from __future__ import annotations

import gc
import os
import subprocess
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
    "device_memory_by_process",
    "loader_run",
    "replicate_photos",
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


def replicate_photos(folder: Path, out: Path, min_train: int) -> tuple[Path, int]:
    """`folder` (class folders, or split folders of class folders) with its training images
    linked ``k`` times over (``r{k}-NAME``), the fewest copies that give >= `min_train` of them;
    other splits linked once. Returns (the new folder, copies): at 800 photos an epoch is 6
    batches, all start-up and prefetched backlog; a steady rate needs hundreds.
    """
    from fastdata.write.sources.folder import SPLIT_NAMES

    splits = [d for d in sorted(folder.iterdir()) if d.is_dir() and d.name in SPLIT_NAMES]
    train = next((d for d in splits if d.name == "train"), None)
    tree = folder if train is None else train
    images = [p for p in sorted(tree.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    if not images:
        raise FileNotFoundError(f"no training images under {tree}")
    copies = max(1, -(-min_train // len(images)))
    target = out if train is None else out / "train"
    for path in images:
        rel = path.relative_to(tree)
        (target / rel.parent).mkdir(parents=True, exist_ok=True)
        for k in range(copies):
            (target / rel.parent / f"r{k}-{rel.name}").symlink_to(path.resolve())
    for split in splits:
        if split is not train:
            (out / split.name).symlink_to(split.resolve(), target_is_directory=True)
    return out, copies


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
    """One loader run: the DataModule's arguments and how long to time it.

    The loader is kept for two epochs: the first holds the start-up (DataModule setup, pipeline
    build, first batch) and warms every cache; the second is timed by
    `fastdata.read.steady.steady_rate` after its backlog (``workers x prefetch`` batches, or
    the 2 a GPU backend prefetches) and `warmup` batches more, over `measure` batches.
    """

    batch_size: int
    preset: str
    image_size: int | None
    workers: int
    warmup: int
    measure: int
    deadline: float  # time.monotonic() after which the first epoch stops early
    loader_timeout_s: float
    prefetch: int = 2


def _datamodule(root: Path, backend: str, s: RunSettings) -> Any:
    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.read import WorkerSettings

    # A fixed prefetch depth (the backlog to skip is workers x prefetch), a loader timeout, a
    # safe worker start method.
    workers = WorkerSettings(
        num_workers=s.workers,
        prefetch_factor=s.prefetch,
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
    """`backend` on the train split until augmented batches are on `device`: start-up, the
    first epoch, and the steady rate, CPU cost and device memory of the second epoch."""
    from fastdata.read import get_backend

    probe = MemoryProbe(device)
    t0 = time.perf_counter()
    dm = _datamodule(root, backend, s)
    dm.setup("fit")
    loader = dm.train_dataloader()
    result: dict[str, Any] = {"setup_s": round(time.perf_counter() - t0, 3)}

    def ready(batch: Any) -> int:
        x = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)[0]
        sync(device)
        return int(x.shape[0])

    uses_workers = get_backend(backend).uses_workers and s.workers > 0
    backlog = s.workers * s.prefetch if uses_workers else 2
    result.update(first_epoch(loader, ready, s))
    probe.sample()
    joules0 = energy() if energy else None
    result.update(second_epoch(loader, ready, backlog, s, device))
    joules1 = energy() if energy else None
    if joules0 is not None and joules1 is not None and result.get("steady_images"):
        per_1k = 1e3 * (joules1 - joules0) / result["steady_images"]
        result["energy_j_per_1k_images"] = round(per_1k, 3)
    probe.sample()
    _release(loader, dm, device)
    loader = dm = None  # the last references: the store and pools can go
    _collect(device)
    probe.sample(closed=True)
    result.update(probe.result())
    return result


def first_epoch(loader: Any, ready: Callable[[Any], int], s: RunSettings) -> dict[str, Any]:
    """The first epoch, whole (or until the deadline): its first batch (start-up) and rate."""
    t0 = time.perf_counter()
    images, first_s = 0, None
    for batch in loader:
        images += ready(batch)
        if first_s is None:
            first_s = time.perf_counter() - t0
        if time.monotonic() > s.deadline:
            break
    seconds = time.perf_counter() - t0
    return {
        "first_batch_s": None if first_s is None else round(first_s, 4),
        "epoch1_images": images,
        "epoch1_images_per_s": round(images / seconds, 1) if seconds > 0 else None,
    }


def second_epoch(
    loader: Any, ready: Callable[[Any], int], backlog: int, s: RunSettings, device: torch.device
) -> dict[str, Any]:
    """The second epoch of the same loader: the steady rate, CPU seconds per 1,000 images (this
    process and its workers) and device memory per process, sampled in the timed window."""
    from fastdata.read.steady import process_tree_cpu_seconds, steady_rate

    memory: dict[str, Any] = {}
    done = [0]

    def ready_and_sample(batch: Any) -> int:
        n = ready(batch)
        done[0] += 1
        if done[0] == backlog + s.warmup + s.measure // 2 and device.type == "cuda":
            memory.update(device_memory_by_process())  # mid-window: every worker is up
        return n

    found = steady_rate(
        iter(loader), backlog=backlog, warmup=s.warmup, measure=s.measure,
        ready=ready_and_sample, cpu_clock=process_tree_cpu_seconds,
    )  # fmt: skip
    return {
        "steady_images_per_s": None if found.images_per_s is None else round(found.images_per_s, 1),
        "steady_note": found.reason or None,
        "steady_batches": found.batches,
        "steady_images": found.images,
        "skipped_batches": found.skipped,
        "cpu_core_s_per_1k_images": (
            None if found.cpu_s_per_1k is None else round(found.cpu_s_per_1k, 3)
        ),
        "epoch2_first_batch_s": None
        if found.first_batch_s is None
        else round(found.first_batch_s, 4),
        **memory,
    }


def device_memory_by_process(
    query: Callable[[], str] | None = None, pid: int | None = None
) -> dict[str, Any]:
    """Device memory (MiB) of this process and of its child processes (the loader's workers),
    from ``nvidia-smi --query-compute-apps``; {} where nvidia-smi does not answer.

    Args:
        query: returns nvidia-smi's CSV ("pid, used_memory" lines; injectable for tests).
        pid: the process whose tree is reported (default: this one).
    """
    import psutil

    me = psutil.Process(pid)
    children = {c.pid for c in me.children(recursive=True)}
    try:
        text = query() if query is not None else _smi_compute_apps()
    except (OSError, subprocess.SubprocessError) as exc:
        return {"device_mib_note": f"nvidia-smi: {type(exc).__name__}: {exc}"[:200]}
    used: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            try:
                used[int(parts[0])] = float(parts[1])
            except ValueError:
                continue
    workers = {p: used[p] for p in sorted(children) if p in used}
    return {
        "device_mib_main": used.get(me.pid, 0.0),
        "device_mib_workers": round(sum(workers.values()), 1),
        "workers_with_cuda": len(workers),
    }


def _smi_compute_apps() -> str:
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=True).stdout


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
