"""Loader throughput on the CPU: fastdata backends against the usual baselines, side by side.

    python benchmarks/bench_loader.py [--workers 2] [--out DIR] [--quick]
    python benchmarks/bench_loader.py --suites memory-first,photo   # some suites alone

CIFAR-100 train (batch 256, `--workers` loader processes); an image counts when it is an augmented,
normalized float batch ready for the model (for fastdata: after `on_after_batch_transfer`):
  - webdataset: PNG shards, `WebDataset` with per-sample PIL decode + pad-crop + flip + to-tensor +
    normalize, `WebLoader` (the WebDataset docs' recipe);
  - map-style: a Dataset over in-memory uint8 arrays with the same per-sample augmentation, DataLoader;
  - fastdata cpu: raw shards, whole-batch decode in workers, batched augmentation after transfer;
  - fastdata memory: the decoded split held in memory, batched augmentation;
  - fastdata dali: DALI's CPU operators (device_id=None), augmentation inside DALI.
clothing-small train (800 JPEGs, 224 px random-resized-crop + flip, batch 64):
  - Pillow per-sample: ImageFolder-style Dataset, full decode, crop, resize, flip, to-tensor, normalize;
  - fastdata cpu: the crop's JPEG region decoded (libjpeg-turbo: fastdata's extension, or
    Pillow where it is not built; the JSON records which) and resized
    (torch's uint8 antialiased kernel) in the workers, flipped there, normalized after transfer;
    once more with 2 decode threads;
  - fastdata dali: DALI CPU decode with random crop.
  Every photo method runs `--photo-rounds` times, round-robin; a row gives its median img/s and the
  range of its per-round ratios to the baseline.
memory-first: one whole first epoch (a fresh DataModule; start-up, workers and any cache count) of
fastdata memory (decode once + build the store, its disk cache removed before) against fastdata
cpu, alternated `--first-rounds` times, on CIFAR-100 train (batch 256, cifar preset) and
clothing-small train (224 px photo preset, batch 64).
Targets (issues): fastdata cpu >= 3x webdataset and >= 1.5x map-style; memory >= 5x dali and >= 5x
webdataset; photo: fastdata cpu >= 2.0x Pillow per-sample (issue 11); memory-first: the memory
backend's first epoch no slower than the cpu backend's (cpu / memory seconds >= 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from baselines import ArrayDataset, PhotoFolder, webdataset_loader  # noqa: I001
from common import measure_throughput, print_table, results_dir, round_robin, save_results
from fastdata_pipelines.env import data_dir
from torch.utils.data import DataLoader

from fastdata import WorkerSettings
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.read.backends.memory import clear_device_cache
from fastdata.read.stores.decoded_cache import CACHE_DIR_ENV
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=data_dir())
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--prefetch", type=int, default=4, help="prefetch_factor of every method's loader"
    )
    p.add_argument("--batches", type=int, default=120, help="timed CIFAR batches per method")
    p.add_argument("--photo-epochs", type=int, default=3, help="timed clothing epochs per method")
    p.add_argument(
        "--photo-rounds",
        type=int,
        default=3,
        help="photo: rounds of every method, run round-robin; rows give the median",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: few batches")
    p.add_argument("--skip-dali", action="store_true")
    p.add_argument(
        "--suites",
        default=",".join(SUITES),
        type=lambda text: [name for name in text.split(",") if name],
        help=f"comma-separated suites to run, of {','.join(SUITES)}",
    )
    p.add_argument("--first-rounds", type=int, default=2, help="memory-first: runs of each")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown:
        p.error(f"unknown suites {unknown}; known: {', '.join(SUITES)}")
    return args


# ------------------------------------------------------------------ runs


def _warmup(args) -> int:
    """Untimed batches: past the start-up burst of `workers * prefetch` batches made in advance."""
    return args.workers * args.prefetch + 1


def _loader_kwargs(args) -> dict[str, Any]:
    w = args.workers
    return dict(
        num_workers=w, persistent_workers=w > 0, prefetch_factor=args.prefetch if w else None
    )


def _train_loader(
    root: Path, backend: str, batch: int, args, decode_threads: int = 1, **kw
) -> tuple[Any, Any]:
    """A set-up ShardDataModule with the run's worker settings, and its training loader."""
    workers = WorkerSettings(
        num_workers=args.workers, prefetch_factor=args.prefetch, decode_threads=decode_threads
    )
    dm = ShardDataModule(root, batch_size=batch, backend=backend, workers=workers, **kw)
    dm.setup("fit")
    return dm, dm.train_dataloader()


def fastdata_run(
    root: Path, backend: str, batch: int, args, limit: int | None, **kw
) -> dict[str, Any]:
    dm, loader = _train_loader(root, backend, batch, args, **kw)

    def consume(b) -> int:
        x, _ = dm.on_after_batch_transfer(b, 0)
        return x.shape[0]

    def epochs():
        while True:
            yield from loader

    result = measure_throughput(epochs(), consume, warmup=_warmup(args), max_batches=limit)
    getattr(loader.loader, "close", lambda: None)()
    return result


def plain_run(loader, args, limit: int | None) -> dict[str, Any]:
    def epochs():
        while True:
            yield from loader

    consume = lambda b: b[0].shape[0]  # noqa: E731
    return measure_throughput(epochs(), consume, warmup=_warmup(args), max_batches=limit)


def cifar_suite(args, work: Path) -> list[dict[str, Any]]:
    import webdataset as wds

    source = open_source("cifar100", args.data / "cifar-100-python.tar.gz")
    n = source.splits()["train"]
    pixels = np.stack([source.item("train", i).pixels for i in range(n)])
    labels = np.array([source.item("train", i).label for i in range(n)])
    png = work / "wds-png"
    png.mkdir()
    with wds.ShardWriter(str(png / "train-%06d.tar"), maxcount=10_000, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"{i:08d}", "png": pixels[i], "cls": int(labels[i])})
    shards = cifar_shards(args, work)
    b, limit = 256, args.batches
    urls = sorted(str(f) for f in png.glob("*.tar"))
    runs = {
        "webdataset (PNG, per-sample PIL)": lambda: plain_run(
            webdataset_loader(urls, b, args.workers, args.prefetch), args, limit
        ),
        "map-style (arrays, per-sample aug)": lambda: plain_run(
            DataLoader(
                ArrayDataset(pixels, labels),
                batch_size=b,
                shuffle=True,
                drop_last=True,
                **_loader_kwargs(args),
            ),
            args,
            limit,
        ),
        "fastdata cpu": lambda: fastdata_run(shards, "cpu", b, args, limit),
        # 1,200 batches last about a second: fewer are mostly noise at ~200,000 img/s.
        "fastdata memory": lambda: fastdata_run(shards, "memory", b, args, max(limit, 1200)),
    }
    if not args.skip_dali:
        runs["fastdata dali (CPU operators)"] = lambda: fastdata_run(shards, "dali", b, args, limit)
    return round_robin(runs, baseline="webdataset (PNG, per-sample PIL)")


def cifar_shards(args, work: Path) -> Path:
    """fastdata raw shards of CIFAR-100 under `work` (written once per run)."""
    shards = work / "fastdata"
    if not (shards / "manifest.json").exists():
        source = open_source("cifar100", args.data / "cifar-100-python.tar.gz")
        write_shards(source, shards, ShardOptions(progress=False))
    return shards


def photo_shards(args, work: Path) -> Path:
    """fastdata shards of clothing-small under `work` (written once per run)."""
    shards = work / "clothing"
    if not (shards / "manifest.json").exists():
        write_shards(
            open_source("folder", args.data / "clothing-small"),
            shards,
            ShardOptions(progress=False),
        )
    return shards


def photo_suite(args, work: Path) -> list[dict[str, Any]]:
    root = args.data / "clothing-small"
    shards = photo_shards(args, work)
    b = 64
    limit = args.photo_epochs * (800 // b)
    runs = {
        "Pillow per-sample DataLoader": lambda: plain_run(
            DataLoader(
                PhotoFolder(root / "train", 224),
                batch_size=b,
                shuffle=True,
                drop_last=True,
                **_loader_kwargs(args),
            ),
            args,
            limit,
        ),
        "fastdata cpu (region decode)": lambda: fastdata_run(
            shards, "cpu", b, args, limit, image_size=224
        ),
        "fastdata cpu, 2 decode threads": lambda: fastdata_run(
            shards, "cpu", b, args, limit, image_size=224, decode_threads=2
        ),
    }
    if not args.skip_dali:
        runs["fastdata dali (CPU operators)"] = lambda: fastdata_run(
            shards, "dali", b, args, limit, image_size=224
        )
    return round_robin(runs, baseline="Pillow per-sample DataLoader", rounds=args.photo_rounds)


def first_epoch(root: Path, backend: str, batch: int, args, **kw) -> dict[str, Any]:
    """One whole first epoch of a fresh `ShardDataModule`: set-up, workers and caches count.

    The memory backend starts without its decoded cache (a fresh $FASTDATA_CACHE_DIR) and
    without this process's placed stores, so its epoch includes decoding and building the store.
    """
    saved = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="decoded_", dir=root.parent)
    clear_device_cache()
    try:
        start = time.perf_counter()
        dm, loader = _train_loader(root, backend, batch, args, **kw)
        ready = time.perf_counter() - start
        images = sum(dm.on_after_batch_transfer(b, 0)[0].shape[0] for b in loader)
        seconds = time.perf_counter() - start
        getattr(loader.loader, "close", lambda: None)()
        del dm, loader
        # Shut the finished loader's workers down here: collected later, in a forked worker of
        # the next loader, its iterator fails "can only test a child process".
        gc.collect()
    finally:
        shutil.rmtree(os.environ[CACHE_DIR_ENV], ignore_errors=True)
        if saved is None:
            os.environ.pop(CACHE_DIR_ENV)
        else:
            os.environ[CACHE_DIR_ENV] = saved
        clear_device_cache()
    return {"images": images, "seconds": seconds, "setup_s": ready}


def memory_first_suite(args, work: Path) -> list[dict[str, Any]]:
    """memory's first epoch (decode + build the store + the epoch) against cpu's, alternated."""
    datasets = {
        "CIFAR-100 train": (cifar_shards(args, work), 256, {}),
        "clothing-small train": (photo_shards(args, work), 64, {"image_size": 224}),
    }
    rows = []
    for dataset, (root, batch, kw) in datasets.items():
        runs: dict[str, list[dict[str, Any]]] = {"cpu": [], "memory": []}
        for _ in range(args.first_rounds):  # alternated: a load change hurts both alike
            for backend, done in runs.items():
                done.append(first_epoch(root, backend, batch, args, **kw))
                print(f"  {dataset}, {backend} first epoch: {done[-1]['seconds']:.2f} s")
        for backend, done in runs.items():
            seconds = float(np.mean([r["seconds"] for r in done]))
            rows.append(
                {
                    "dataset": dataset,
                    "method": f"fastdata {backend}, first epoch",
                    "seconds": round(seconds, 2),
                    "setup_s": round(float(np.mean([r["setup_s"] for r in done])), 2),
                    "img_per_s": round(done[0]["images"] / seconds, 1),
                    "rounds_s": [round(r["seconds"], 2) for r in done],
                }
            )
        cpu, mem = rows[-2]["seconds"], rows[-1]["seconds"]
        rows[-1]["cpu_over_memory"] = round(cpu / mem, 2)
    return rows


def ratios(
    cifar: list[dict], photo: list[dict], first: list[dict] | None = None
) -> dict[str, float | None]:
    """The target ratios of the suites that ran (None where a method is missing)."""

    def rate(rows, name):
        return next((r.get("img_per_s") for r in rows if r["method"].startswith(name)), None)

    def div(a, b):
        return round(a / b, 2) if a and b else None

    c = {
        k: rate(cifar, k)
        for k in ("webdataset", "map-style", "fastdata cpu", "fastdata memory", "fastdata dali")
    }
    p = {
        k: rate(photo, k) for k in ("Pillow", "fastdata cpu (", "fastdata cpu, 2", "fastdata dali")
    }
    found = {
        "cifar: fastdata cpu / webdataset (target >= 3)": div(c["fastdata cpu"], c["webdataset"]),
        "cifar: fastdata cpu / map-style (target >= 3)": div(c["fastdata cpu"], c["map-style"]),
        "cifar: memory / dali cpu (target >= 5)": div(c["fastdata memory"], c["fastdata dali"]),
        "cifar: memory / webdataset (target >= 5)": div(c["fastdata memory"], c["webdataset"]),
        "photo: fastdata cpu / Pillow per-sample (target >= 2.5)": div(
            p["fastdata cpu ("], p["Pillow"]
        ),
        "photo: fastdata cpu, 2 decode threads / Pillow per-sample": div(
            p["fastdata cpu, 2"], p["Pillow"]
        ),
    }
    for row in first or []:
        if "cpu_over_memory" in row:
            key = f"first epoch, {row['dataset']}: cpu s / memory s (target >= 1)"
            found[key] = row["cpu_over_memory"]
    return found


SUITES = {"cifar": cifar_suite, "memory-first": memory_first_suite, "photo": photo_suite}
_TITLES = {
    "cifar": "CIFAR-100 train loader, batch 256, {w} workers, CPU",
    "memory-first": "first epoch (fresh DataModule, memory cache removed), {w} workers, CPU",
    "photo": "clothing-small 224 px random-resized-crop, batch 64, {w} workers, CPU",
}
_COLUMNS = {
    "memory-first": ["dataset", "method", "seconds", "setup_s", "img_per_s", "cpu_over_memory"],
}


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.batches, args.photo_epochs, args.first_rounds, args.photo_rounds = 10, 1, 1, 1
    out = results_dir(args.out)
    work = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    found: dict[str, list[dict[str, Any]]] = {}
    try:
        for name in args.suites:
            found[name] = SUITES[name](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cols = ["method", "img_per_s", "vs_baseline", "range", "images", "seconds", "error"]
    tables = [
        print_table(rows, _COLUMNS.get(name, cols), _TITLES[name].format(w=args.workers))
        for name, rows in found.items()
    ]
    summary = ratios(found.get("cifar", []), found.get("photo", []), found.get("memory-first"))
    summary = {k: v for k, v in summary.items() if v is not None}
    tables.append(
        print_table(
            [{"ratio": k, "value": v} for k, v in summary.items()], ["ratio", "value"], "Targets"
        )
    )
    results = {"args": vars(args) | {"data": str(args.data)}, **found, "ratios": summary}
    save_results("bench_loader", out, results, tables)
    return results


if __name__ == "__main__":
    main(parse_args())
