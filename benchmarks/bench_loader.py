"""Loader throughput on the CPU: fastdata backends against the usual baselines, side by side.

    python benchmarks/bench_loader.py [--workers 2] [--out DIR] [--quick]

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
  - fastdata cpu: Pillow-SIMD decode with JPEG draft mode at the crop's scale, batched flip/normalize;
  - fastdata dali: DALI CPU decode with random crop.
Targets (issues): fastdata cpu >= 3x webdataset and >= 1.5x map-style; memory >= 5x dali and >= 5x
webdataset; photo: fastdata cpu >= 1.5x Pillow per-sample.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import measure_throughput, print_table, results_dir, save_results  # noqa: I001
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from fastdata._env import data_dir
from fastdata.augment import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD, rrc_params
from fastdata.datamodule import ShardDataModule
from fastdata.sources import open_source
from fastdata.write import ShardOptions, write_shards


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=data_dir())
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--prefetch", type=int, default=4, help="prefetch_factor of every method's loader"
    )
    p.add_argument("--batches", type=int, default=120, help="timed CIFAR batches per method")
    p.add_argument("--photo-epochs", type=int, default=3, help="timed clothing epochs per method")
    p.add_argument("--quick", action="store_true", help="a smoke run: few batches")
    p.add_argument("--skip-dali", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# ------------------------------------------------------------------ per-sample baselines


def _to_tensor(pixels: np.ndarray, mean, std) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float()
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def cifar_augment(pixels: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """torchvision-style per sample: RandomCrop(32, padding=4), flip, ToTensor, Normalize."""
    padded = np.pad(pixels, ((4, 4), (4, 4), (0, 0)))
    top, left = rng.integers(0, 9, size=2)
    crop = padded[top : top + 32, left : left + 32]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return _to_tensor(crop, CIFAR100_MEAN, CIFAR100_STD)


def _process_rng() -> np.random.Generator:
    """A generator per process, so that DataLoader workers do not draw identical augmentations."""
    return np.random.default_rng([0, os.getpid()])


class ArrayDataset(Dataset):
    """Map-style: in-memory uint8 arrays, per-sample augmentation."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray) -> None:
        self.pixels, self.labels = pixels, labels
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        self.rng = self.rng or _process_rng()
        return cifar_augment(self.pixels[i], self.rng), int(self.labels[i])


def webdataset_loader(urls: list[str], batch_size: int, workers: int, prefetch: int):
    import webdataset as wds

    state: dict[str, np.random.Generator] = {}

    def augment(image: Image.Image) -> torch.Tensor:
        return cifar_augment(np.asarray(image), state.setdefault("rng", _process_rng()))

    dataset = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=None, workersplitter=wds.split_by_worker
        )
        .shuffle(1000)
        .decode("pil")
        .to_tuple("png", "cls")
        .map_tuple(augment, int)
        .batched(batch_size)
    )
    return wds.WebLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch if workers else None,
    )


class PhotoFolder(Dataset):
    """ImageFolder-style: full Pillow decode, random-resized-crop, flip, to-tensor, per sample."""

    def __init__(self, root: Path, size: int) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (f, i) for i, c in enumerate(classes) for f in sorted((root / c).glob("*.jpg"))
        ]
        self.size = size
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        self.rng = self.rng or _process_rng()
        image = Image.open(path).convert("RGB")
        top, left, h, w = rrc_params(
            image.height, image.width, (0.08, 1.0), (3 / 4, 4 / 3), self.rng
        )
        image = image.resize(
            (self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h)
        )
        if self.rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor(np.asarray(image), IMAGENET_MEAN, IMAGENET_STD), label


# ------------------------------------------------------------------ runs


def _warmup(args) -> int:
    """Untimed batches: past the start-up burst of `workers * prefetch` batches made in advance."""
    return args.workers * args.prefetch + 1


def _loader_kwargs(args) -> dict[str, Any]:
    w = args.workers
    return dict(
        num_workers=w, persistent_workers=w > 0, prefetch_factor=args.prefetch if w else None
    )


def fastdata_run(
    root: Path, backend: str, batch: int, args, limit: int | None, **kw
) -> dict[str, Any]:
    dm = ShardDataModule(
        root,
        batch_size=batch,
        num_workers=args.workers,
        prefetch_factor=args.prefetch,
        backend=backend,
        **kw,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()

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
    shards = work / "fastdata"
    write_shards(source, shards, ShardOptions(progress=False))
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
    return _rows(runs, baseline="webdataset (PNG, per-sample PIL)")


def photo_suite(args, work: Path) -> list[dict[str, Any]]:
    root = args.data / "clothing-small"
    shards = work / "clothing"
    write_shards(open_source("folder", root), shards, ShardOptions(progress=False))
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
        "fastdata cpu (draft-mode decode)": lambda: fastdata_run(
            shards, "cpu", b, args, limit, image_size=224
        ),
    }
    if not args.skip_dali:
        runs["fastdata dali (CPU operators)"] = lambda: fastdata_run(
            shards, "dali", b, args, limit, image_size=224
        )
    return _rows(runs, baseline="Pillow per-sample DataLoader")


def _rows(runs: dict[str, Any], baseline: str) -> list[dict[str, Any]]:
    rows = []
    for name, run in runs.items():
        try:
            result = run()
        except Exception as exc:  # a failing method is reported, not fatal to the others
            rows.append({"method": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append({"method": name, **result})
        print(f"  {name}: {result['img_per_s']:,.0f} img/s")
    base = next(
        (r["img_per_s"] for r in rows if r["method"] == baseline and "img_per_s" in r), None
    )
    for row in rows:
        if base and "img_per_s" in row:
            row["vs_baseline"] = round(row["img_per_s"] / base, 2)
    return rows


def ratios(cifar: list[dict], photo: list[dict]) -> dict[str, float | None]:
    def rate(rows, name):
        return next((r.get("img_per_s") for r in rows if r["method"].startswith(name)), None)

    def div(a, b):
        return round(a / b, 2) if a and b else None

    c = {
        k: rate(cifar, k)
        for k in ("webdataset", "map-style", "fastdata cpu", "fastdata memory", "fastdata dali")
    }
    p = {k: rate(photo, k) for k in ("Pillow", "fastdata cpu", "fastdata dali")}
    return {
        "cifar: fastdata cpu / webdataset (target >= 3)": div(c["fastdata cpu"], c["webdataset"]),
        "cifar: fastdata cpu / map-style (target >= 1.5)": div(c["fastdata cpu"], c["map-style"]),
        "cifar: memory / dali cpu (target >= 5)": div(c["fastdata memory"], c["fastdata dali"]),
        "cifar: memory / webdataset (target >= 5)": div(c["fastdata memory"], c["webdataset"]),
        "photo: fastdata cpu / Pillow per-sample (target >= 1.5)": div(
            p["fastdata cpu"], p["Pillow"]
        ),
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.batches, args.photo_epochs = 10, 1
    out = results_dir(args.out)
    work = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        cifar = cifar_suite(args, work)
        photo = photo_suite(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cols = ["method", "img_per_s", "vs_baseline", "images", "seconds", "error"]
    tables = [
        print_table(cifar, cols, f"CIFAR-100 train loader, batch 256, {args.workers} workers, CPU"),
        print_table(
            photo,
            cols,
            f"clothing-small 224 px random-resized-crop, batch 64, {args.workers} workers, CPU",
        ),
    ]
    summary = ratios(cifar, photo)
    tables.append(
        print_table(
            [{"ratio": k, "value": v} for k, v in summary.items()], ["ratio", "value"], "Targets"
        )
    )
    results = {
        "args": vars(args) | {"data": str(args.data)},
        "cifar": cifar,
        "photo": photo,
        "ratios": summary,
    }
    save_results("bench_loader", out, results, tables)
    return results


if __name__ == "__main__":
    main(parse_args())
