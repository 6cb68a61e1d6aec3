"""What the read-side integrity checks cost: a CIFAR-100 cpu-backend epoch with and without them.

    python benchmarks/bench_integrity.py [--out DIR] [--rounds 3] [--workers 0]

CIFAR-100 (../shared/data, or $FASTDATA_DATA_DIR) is sharded into a temporary folder (raw pixels,
5,000 images a shard), then one training epoch of the train split (batch 256, preset "none") is
read through the cpu backend (`fastdata.read.backends.cpu.make_cpu_loader`) three ways, round-robin:

- unchecked: the every-read checks switched off in this process (no index sha256, no tar header
  match, no label range check) - what a reader did before they existed;
- checked: the default (index sha256 at shard load, tar header and label on every sample);
- verify_samples: checked, plus the per-sample BLAKE2b digest (`verify_samples=True`).

The round-robin ratio is noisy on a shared machine, so the shard-open checks are also timed
directly (index sha256 + `scan_shard` per shard, times the shard opens of an epoch) and given as
a share of the unchecked epoch; the per-sample work left on every read is a set lookup.

Reported: images per CPU second of each (median of the rounds; with --workers 0 every step runs
in this process, and CPU time is far less disturbed than the wall clock by other processes on
a shared machine) and its ratio to "unchecked" in the same run; the target is checked >= 0.95
of unchecked. Results go to bench_integrity.json / .md with the
environment and the CPU model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import print_table, results_dir, round_robin, save_results  # noqa: I001  (script)
from fastdata_pipelines.env import data_dir

from fastdata.format.integrity import scan_shard
from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.read import shard_index, shardio
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec, WorkerSettings
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    return parser.parse_args()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform says)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """The every-read checks switched off in this process (and in workers forked inside)."""
    reader = shardio.ShardReader
    saved = (shardio.check_header, reader._check_label, reader._suspects, shard_index.read_checked)
    shardio.check_header = lambda *args: None
    reader._check_label = lambda *args: None
    reader._suspects = lambda *args: set()  # no shard scan, and no sample checked when read
    shard_index.read_checked = lambda path, sha256, what: saved[3](path, None, what)
    try:
        yield
    finally:
        shardio.check_header, reader._check_label, reader._suspects, shard_index.read_checked = (
            saved
        )


def shard_open_cost(manifest: Manifest, repeats: int = 5) -> dict[str, Any]:
    """CPU seconds the shard-open checks take per shard (index sha256 + `scan_shard`), best of
    `repeats`, and how many shards an epoch opens (ShardReader keeps 8 open)."""
    per_shard = []
    for info in manifest.split("train").shards:
        text = Path(manifest.index_url(info)).read_bytes()
        index = shard_index.parse_index(text.decode(), info.name)
        data = np.frombuffer(Path(manifest.shard_url(info)).read_bytes(), dtype=np.uint8)
        times = []
        for _ in range(repeats):
            start = time.process_time()  # CPU time: less disturbed by other processes
            hashlib.sha256(text).hexdigest()
            scan_shard(data, index.keys, index.layout, manifest.num_classes)
            times.append(time.process_time() - start)
        per_shard.append(min(times))
        del data
    opens = 0
    original = shardio.load_index

    def counting(*args: Any) -> Any:
        nonlocal opens
        opens += 1
        return original(*args)

    shardio.load_index = counting
    try:
        epoch(manifest, 0)
    finally:
        shardio.load_index = original
    return {"seconds_per_shard_open": statistics.median(per_shard), "opens_per_epoch": opens}


def epoch(manifest: Manifest, workers: int, verify_samples: bool = False) -> dict[str, Any]:
    """One training epoch of the train split through the cpu backend; images and seconds."""
    spec = LoaderSpec(
        manifest=manifest,
        split="train",
        train=True,
        batch_size=256,
        preset="none",
        workers=WorkerSettings(num_workers=workers),
        verify_samples=verify_samples,
    )
    loader = make_cpu_loader(spec)
    start, cpu_start = time.perf_counter(), time.process_time()
    images = sum(len(labels) for _, labels in loader)
    cpu = time.process_time() - cpu_start
    wall = time.perf_counter() - start
    # img_per_s is per CPU second of this process (workers=0: all the work is here): on a
    # shared machine the wall clock mostly measures the other processes.
    return {
        "images": images,
        "seconds": round(cpu, 3),
        "img_per_s": images / cpu,
        "wall_img_per_s": round(images / wall, 1),
    }


def main(args: argparse.Namespace) -> None:
    archive = data_dir() / "cifar-100-python.tar.gz"
    if not archive.exists():
        raise SystemExit(
            f"skipped: {archive} not found; set FASTDATA_DATA_DIR to the shared data folder"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-integrity-"))
    try:
        options = ShardOptions(max_count=5000, workers=2, encoding="raw", progress=False)
        write_shards(open_source("cifar100", str(archive)), work / "shards", options)
        manifest = load_manifest(work / "shards")

        def plain() -> dict[str, Any]:
            with unchecked():
                return epoch(manifest, args.workers)

        runs = {
            "unchecked": plain,
            "checked": lambda: epoch(manifest, args.workers),
            "verify_samples": lambda: epoch(manifest, args.workers, verify_samples=True),
        }
        epoch(manifest, args.workers)  # warm the page cache and the imports
        rows = round_robin(runs, baseline="unchecked", rounds=args.rounds)
        opens = shard_open_cost(manifest)
        base = next(r for r in rows if r["method"] == "unchecked")
        epoch_s = base["images"] / base["img_per_s"] / args.rounds
        direct = opens["seconds_per_shard_open"] * opens["opens_per_epoch"] / epoch_s
        columns = ["method", "img_per_s", "vs_baseline", "range", "images", "seconds"]
        title = (
            f"CIFAR-100 train (raw, {manifest.split('train').num_samples:,} images), cpu backend, "
            f"{args.workers} workers, {args.rounds} rounds, CPU {cpu_model()}"
        )
        table = print_table(rows, columns, title)
        table += (
            f"\nshard-open checks (index sha256 + scan_shard): "
            f"{opens['seconds_per_shard_open'] * 1e3:.1f} ms a shard x {opens['opens_per_epoch']} "
            f"opens an epoch = {direct:.2%} of an unchecked epoch ({epoch_s:.2f} s)\n"
        )
        print(table.splitlines()[-1])
        checked = next((r for r in rows if r["method"] == "checked"), {})
        results = {
            "rows": rows,
            "cpu_model": cpu_model(),
            "workers": args.workers,
            "rounds": args.rounds,
            "checked_cost": round(1 - checked["vs_baseline"], 3)
            if "vs_baseline" in checked
            else None,
            "shard_open_checks": opens,
            "unchecked_epoch_seconds": round(epoch_s, 3),
            "shard_open_checks_share_of_epoch": round(direct, 4),
            "target": "checked costs under 5% of an unchecked epoch (vs_baseline >= 0.95)",
        }
        save_results("bench_integrity", results_dir(args.out), results, [table])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(parse_args())
