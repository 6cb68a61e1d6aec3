"""Shared by the peer workers (`peers_litdata.py`, `peers_streaming.py`): input, transforms, timing
(also used by `bench_peers.py`, in fastdata's venv: `time_epochs`, `LoadWatcher`).

Runs in the peers' own venv (`.venv-peers`, see `setup_peers.sh`), never in fastdata's: it imports
torchvision (the transforms the peers' READMEs use) and, for the engine-only runs, only
`fastdata.augment` from this checkout (torch alone; fastdata is not installed there).

Both peers read the same input as fastdata: the CIFAR-100 archive (train and test splits) and the
clothing-small folder (train, validation, test class folders of JPEGs).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `fastdata.augment` from the checkout (not installed here)

__all__ = [
    "CIFAR_SPLITS",
    "LoadWatcher",
    "PHOTO_SPLITS",
    "cifar_split",
    "engine_consumer",
    "photo_items",
    "readme_transform",
    "engine_geometry",
    "time_conversion",
    "time_epochs",
    "versions",
]

CIFAR_SPLITS = ("train", "test")
PHOTO_SPLITS = ("train", "validation", "test")
CIFAR_MEMBER = "cifar-100-python/{split}"


# ------------------------------------------------------------------ input


@lru_cache(maxsize=2)
def cifar_split(archive: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, 32, 32, 3) uint8 pixels and fine labels of one split, read from the official archive.

    Cached per process, so a conversion worker unpickles its split once, however many items it
    writes (the way a user's `optimize` fn or writer process would hold the loaded split).
    """
    with tarfile.open(archive, "r:gz") as tar:
        member = tar.extractfile(CIFAR_MEMBER.format(split=split))
        if member is None:
            raise FileNotFoundError(f"{archive}: no member {CIFAR_MEMBER.format(split=split)}")
        entry = pickle.load(io.BytesIO(member.read()), encoding="bytes")
    pixels = np.asarray(entry[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(pixels), np.asarray(entry[b"fine_labels"], np.int64)


def photo_items(root: str, split: str) -> list[tuple[str, int]]:
    """(path, label) of every JPEG under `root/split/<class>/`, classes sorted by name."""
    folder = Path(root) / split
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    return [
        (str(f), label)
        for label, name in enumerate(classes)
        for f in sorted((folder / name).glob("*.jpg"))
    ]


# ------------------------------------------------------------------ transforms


def readme_transform(dataset: str) -> Callable[[Any], torch.Tensor]:
    """The per-sample torchvision pipeline a README user writes: augment, to float, normalize."""
    from torchvision.transforms import v2

    from fastdata.augment import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD

    # ToImage first: the samples arrive as uint8 arrays, tensors or PIL images depending on the
    # library, and torchvision v2 runs its geometry faster on tensors than on PIL images.
    if dataset == "cifar":
        geometry = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
        mean, std = CIFAR100_MEAN, CIFAR100_STD
    else:
        geometry = [v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    return v2.Compose(
        [
            v2.ToImage(),
            *geometry,
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([m / 255 for m in mean], [s / 255 for s in std]),
        ]
    )


def engine_geometry(dataset: str) -> Callable[[Any], torch.Tensor]:
    """What the loader itself must do in the engine-only runs, to a uint8 CHW tensor.

    CIFAR: nothing but array -> uint8 tensor (crop, flip and normalize run batched after transfer).
    Photos differ in size, so a batch needs each cropped to 224 px first: the worker does the
    random-resized-crop and flip (as fastdata's cpu decoder does), the batch is normalized after.
    """
    from torchvision.transforms import v2

    steps = [] if dataset == "cifar" else [v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()]
    return v2.Compose([v2.ToImage(), *steps])


def engine_consumer(dataset: str, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """fastdata's batched work on a uint8 batch after transfer, as its datamodule runs it.

    CIFAR: the "cifar" preset (pad-crop + flip + normalize). Photos: the workers already cropped
    and flipped (`engine_geometry`, where fastdata's cpu decoder does it too), so only fastdata's
    batched `normalize` is left.
    """
    from fastdata.augment import IMAGENET_MEAN, IMAGENET_STD, get_preset, normalize

    try:  # fastdata's datamodule reuses output memory (a fresh 38 MB batch page-faults 9,400x)
        from fastdata._util.pool import TensorPool

        pool = TensorPool()
    except ImportError:  # private, may move: then plain fresh outputs (slower, still correct)
        pool = None
    preset = get_preset("cifar")
    generator = torch.Generator().manual_seed(seed)

    def work(x: torch.Tensor) -> torch.Tensor:
        if dataset == "cifar":
            return preset.apply(x, train=True, generator=generator, pool=pool)
        out = None if pool is None else pool.empty(tuple(x.shape), torch.float32, x.device)
        return normalize(x, IMAGENET_MEAN, IMAGENET_STD, out=out)

    def apply(x: torch.Tensor) -> torch.Tensor:
        # One intra-op thread, as fastdata's on_after_batch_transfer runs CPU batches
        # (fastdata/_util/threads.py says why: two threads beside busy loader workers wait on each
        # other). Inlined, not imported: that module is private and may move.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return work(x)
        finally:
            torch.set_num_threads(threads)

    return apply


# ------------------------------------------------------------------ timing


def time_conversion(convert: Callable[[], int]) -> dict[str, Any]:
    """Seconds and images/s of `convert()`, which returns the number of samples it wrote."""
    start = time.perf_counter()
    images = convert()
    seconds = time.perf_counter() - start
    return {"images": images, "seconds": round(seconds, 3), "img_per_s": round(images / seconds, 1)}


def time_epochs(
    make_loader: Callable[[], Iterable[Any]],
    consume: Callable[[Any], int],
    epochs: int = 2,
    max_batches: int | None = None,
) -> list[dict[str, Any]]:
    """Time whole epochs; epoch 1 includes building the dataset and loader (caches count).

    `consume(batch)` must finish the batch (augmented, normalized float) and return its images.
    `max_batches` cuts each epoch short (smoke runs only: the figures are then not epochs).
    """
    start = time.perf_counter()
    loader = make_loader()
    setup = time.perf_counter() - start
    rows = []
    for epoch in range(1, epochs + 1):
        images = batches = 0
        begin = time.perf_counter()
        for batch in loader:
            images += consume(batch)
            batches += 1
            if max_batches is not None and batches >= max_batches:
                break
        seconds = time.perf_counter() - begin + (setup if epoch == 1 else 0.0)
        rows.append(
            {
                "epoch": epoch,
                "images": images,
                "batches": batches,
                "seconds": round(seconds, 3),
                "setup_s": round(setup, 3) if epoch == 1 else 0.0,
                "img_per_s": round(images / seconds, 1),
            }
        )
    return rows


def versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions in this venv ("-" when absent), plus Python's."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def threads_note() -> dict[str, Any]:
    """Torch's intra-op threads and the usable cores of this process (for the results file)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"torch_threads": torch.get_num_threads(), "usable_cores": cores}


class LoadWatcher:
    """Samples, in a thread, which other processes use the CPU while a benchmark runs.

    Every `interval` seconds it reads each process's CPU share since the last sample and keeps,
    per command line, the highest share and how many samples found it at or above `min_percent`.
    This process and its children (the measured loaders) are left out: what remains is the load
    other people put on the machine. Needs psutil.
    """

    def __init__(self, interval: float = 2.0, min_percent: float = 10.0) -> None:
        self.interval, self.min_percent = interval, min_percent
        self.samples = 0
        self.busy: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Samples taken and the busy command lines, busiest first."""
        ranked = sorted(self.busy.items(), key=lambda kv: -kv[1]["max_percent"])
        return {"samples": self.samples, "interval_s": self.interval, "other_busy": dict(ranked)}

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        seen: dict[int, psutil.Process] = {}
        while not self._stop.wait(self.interval):
            mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
            for proc in psutil.process_iter(["cmdline"]):
                if proc.pid in mine:
                    continue
                known = seen.setdefault(proc.pid, proc)
                try:
                    percent = known.cpu_percent(None)  # 0.0 on the first look at a process
                except psutil.Error:
                    continue
                if percent >= self.min_percent:
                    name = _command_name(proc.info["cmdline"]) or f"pid {proc.pid}"
                    entry = self.busy.setdefault(name, {"max_percent": 0.0, "busy_samples": 0})
                    entry["max_percent"] = max(entry["max_percent"], percent)
                    entry["busy_samples"] += 1
            self.samples += 1


def _command_name(cmdline: list[str] | None, limit: int = 120) -> str:
    """A process's command line as the load table shows it: the program's base name, then its
    arguments, cut at `limit` characters (a full interpreter path would push the arguments, which
    tell the processes apart, out of the cut, by a length that depends on where it is installed)."""
    if not cmdline:
        return ""
    return " ".join([os.path.basename(cmdline[0]), *cmdline[1:]])[:limit]
