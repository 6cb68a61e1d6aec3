"""Shuffle quality and cost of the training orders (`fastdata.read.shuffle`): shard, window, full.

    python benchmarks/bench_shuffle.py [--out DIR] [--batch 64] [--epochs 2]

Quality, from the epoch plan alone (MosaicML Streaming's measures, plus one a user sees):
- neighbour distance: mean |row[i+1] - row[i]| of consecutive samples' original row numbers
  (rows in manifest order), as a share of a uniform permutation's (1.0: as random);
- shard entropy: mean entropy (bits) of the shards a batch's samples come from;
- labels/batch: mean distinct labels in a batch of `--batch`, and its ratio to the full
  permutation's ("vs full").
On (a) fastdata's own shards (CIFAR-100 train written by `fastdata shard`, shuffled at write
time, 10,000 a shard: its default), (b) class-ordered foreign shards (clothing-small's 800 train photos in 8
tars of 100 written by a `webdataset.ShardWriter` loop over the sorted class folders, then
`fastdata index`), (c) (a)'s folder served over HTTP (Python's http.server on loopback) with a
shard cache of 40% of the split: the default window is then sized from the cache limit.
Plans: "shard" (the order before this change), "window" at its default size on this node
(`node_window`), "window" of two shards (the smallest that mixes across shards), "full".

Cost: one epoch of the cpu backend through `ShardDataModule` (batch 64, no worker process,
image_size 224 for the photos, stored size for CIFAR; the DataModule's default window) per plan,
`--rounds` times round-robin, as the median img/s and its ratio to the "shard" plan, in the same
run. The whole run takes ~3 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from bench_remote import serve  # noqa: I001  (run as a script)
from common import environment, print_table, results_dir, round_robin, save_results
from fastdata_pipelines.env import data_dir

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.format.schema import label_and_id
from fastdata.read.plan import epoch_order, rows_to_refs
from fastdata.read.shardio import ShardReader
from fastdata.read.shuffle import node_window
from fastdata.remote import ShardCache
from fastdata.write import ShardOptions, write_shards
from fastdata.write.index import index_shards
from fastdata.write.sources import open_source


def row_labels(manifest: Manifest, split: str = "train") -> np.ndarray:
    """Every row's label, in row order (shards in manifest order)."""
    reader = ShardReader(manifest, split)
    labels = []
    try:
        for s, shard in enumerate(manifest.split(split).shards):
            for i in range(shard.num_samples):
                labels.append(label_and_id(reader.key(s, i), reader.sample(s, i))[0])
    finally:
        reader.close()
    return np.asarray(labels)


def quality(
    order: np.ndarray, sizes: list[int], labels: np.ndarray, batch: int
) -> dict[str, float]:
    """Neighbour distance (raw), shard entropy (bits) and distinct labels per batch."""
    shards = rows_to_refs(order, sizes)[:, 0]
    whole = len(order) // batch * batch
    entropy, distinct = [], []
    for lo in range(0, whole, batch):
        counts = np.bincount(shards[lo : lo + batch])
        p = counts[counts > 0] / batch
        entropy.append(float(-(p * np.log2(p)).sum()))
        distinct.append(len(np.unique(labels[order[lo : lo + batch]])))
    return {
        "neighbour": float(np.abs(np.diff(order)).mean()),
        "shard_entropy": float(np.mean(entropy)),
        "labels_per_batch": float(np.mean(distinct)),
    }


def quality_rows(
    name: str, manifest: Manifest, labels: np.ndarray, cache: Any, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    sizes = [s.num_samples for s in manifest.split("train").shards]
    default = node_window(manifest, "train", cache)
    plans = {
        "shard": ("shard", None),
        f"window (default {default})": ("window", default),
        f"window (2 shards, {2 * max(sizes)})": ("window", 2 * max(sizes)),
        "full": ("full", None),
    }
    measured = {}
    for plan, (mode, window) in plans.items():
        runs = [
            quality(epoch_order(sizes, 0, e, True, (), mode, window), sizes, labels, args.batch)
            for e in range(args.epochs)
        ]
        measured[plan] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    full = measured["full"]
    rows = []
    for plan, m in measured.items():
        rows.append(
            {
                "shards": name,
                "plan": plan,
                "neighbour_vs_full": round(m["neighbour"] / full["neighbour"], 3),
                "shard_entropy_bits": round(m["shard_entropy"], 2),
                "labels_per_batch": round(m["labels_per_batch"], 2),
                "labels_vs_full": round(m["labels_per_batch"] / full["labels_per_batch"], 3),
            }
        )
    return rows, {"default_window": default, "samples": int(sum(sizes)), "shards": len(sizes)}


def class_ordered_clothing(src: Path, out: Path) -> Path:
    """clothing-small's train photos, class by class (sorted folders), 100 to a tar, indexed."""
    import webdataset as wds

    folders = sorted(p for p in (data_dir() / "clothing-small" / "train").iterdir() if p.is_dir())
    src.mkdir(parents=True)
    with wds.ShardWriter(str(src / "train-%06d.tar"), maxcount=100, verbose=0) as sink:
        for label, folder in enumerate(folders):
            for photo in sorted(folder.iterdir()):
                key = f"{folder.name}-{photo.stem}".replace(".", "_")
                sink.write({"__key__": key, "jpg": photo.read_bytes(), "cls": str(label)})
    index_shards(src, out)
    return out


def epoch_run(root: Path, shuffle: str | int, image_size: int | None, batch: int):
    def run() -> dict[str, Any]:
        from common import measure_throughput

        dm = ShardDataModule(
            root, batch_size=batch, backend="cpu", image_size=image_size, shuffle=shuffle,
            drop_last=False, workers=WorkerSettings(num_workers=0),
        )  # fmt: skip
        try:
            return measure_throughput(dm.train_dataloader(), lambda b: len(b[1]), warmup=1)
        finally:
            dm.teardown()

    return run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="results folder (default: $OUT or results/)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="epochs averaged (quality)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (median)")
    parser.add_argument("--cache-fraction", type=float, default=0.4, help="remote cache / data")
    return parser.parse_args()


def main(args: argparse.Namespace) -> None:
    logging.getLogger("fastdata").setLevel(logging.ERROR)  # the index's ordered-labels warning
    archive = data_dir() / "cifar-100-python.tar.gz"
    if not archive.exists() or not (data_dir() / "clothing-small").is_dir():
        raise SystemExit(f"CIFAR-100 or clothing-small not in {data_dir()}: set FASTDATA_DATA_DIR")
    work = Path(tempfile.mkdtemp(prefix="bench-shuffle-"))
    server = None
    try:
        options = ShardOptions(max_count=10_000, workers=2, encoding="raw", progress=False)
        write_shards(open_source("cifar100", str(archive)), work / "cifar", options)
        cifar = load_manifest(work / "cifar")
        clothing_root = class_ordered_clothing(work / "clothing-src", work / "clothing")
        clothing = load_manifest(clothing_root)
        cifar_labels, clothing_labels = row_labels(cifar), row_labels(clothing)
        server, url = serve(work / "cifar")
        data_bytes = sum(s.bytes for s in cifar.split("train").shards)
        cache = ShardCache(work / "cache", int(args.cache_fraction * data_bytes))
        rows, windows = [], {}
        for name, manifest, labels, shard_cache in (
            ("own (CIFAR-100)", cifar, cifar_labels, None),
            ("class-ordered (clothing-small)", clothing, clothing_labels, None),
            ("remote own (CIFAR-100, http)", load_manifest(url), cifar_labels, cache),
        ):
            found, windows[name] = quality_rows(name, manifest, labels, shard_cache, args)
            rows += found
        columns = ["shards", "plan", "neighbour_vs_full", "shard_entropy_bits",
                   "labels_per_batch", "labels_vs_full"]  # fmt: skip
        tables = [print_table(rows, columns, f"Shuffle quality (batch {args.batch})")]
        speed = []
        for name, root, size in (
            ("CIFAR-100", work / "cifar", None),
            ("clothing-small", clothing_root, 224),
        ):
            runs = {p: epoch_run(root, p, size, args.batch) for p in ("shard", "window", "full")}
            for row in round_robin(runs, "shard", rounds=args.rounds):
                speed.append({"shards": name, **row})
        tables.append(
            print_table(
                speed,
                ["shards", "method", "img_per_s", "images", "seconds", "vs_baseline", "range"],
                "cpu backend, one epoch through ShardDataModule (vs the shard plan)",
            )
        )
        env = environment()
        tables.append(f"CPU: {env['cpu']}; usable cores {env['usable_cores']}\n")
        save_results(
            "bench_shuffle",
            results_dir(args.out),
            {"args": vars(args), "windows": windows, "quality": rows, "throughput": speed},
            tables,
        )
    finally:
        if server is not None:
            server.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(parse_args())
