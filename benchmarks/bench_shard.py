"""Shard conversion speed of CIFAR-100 against the I/O floor, and the sample-encoding trade-off.

    python benchmarks/bench_shard.py [--out DIR] [--rounds N] [--workers N]

1. Conversion of the full CIFAR-100 archive (60,000 images) into tar shards, each round running:
   - the I/O floor: read and decompress the archive (gzip, zlib in 1 MiB reads), then write as
     many bytes as the fastdata run's output folder holds, one file per file there, each fsync'd
     (as the writer fsyncs its shards);
   - `fastdata shard cifar100 ARCHIVE OUT` as a user runs it: a subprocess, default options,
     start-up (interpreter and imports) included;
   - baseline: a single-process loop writing PNG samples with `webdataset.ShardWriter`
     (the way the WebDataset docs convert a dataset).
   The rows give the median of the rounds. Targets: fastdata within 2x of the floor
   (`vs_floor` <= 2), and >= 2x the baseline.
2. Encoding trade-off for 32x32 images (raw / png / jpeg q90): bytes per sample and CPU time to
   decode one sample (single thread), measured on real CIFAR-100 samples.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO, print_table, results_dir, save_results  # noqa: I001  (run as a script)
from fastdata_pipelines.env import cpu_description, data_dir

from fastdata.write.sources import open_source

_CHUNK = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archive", type=Path, default=data_dir() / "cifar-100-python.tar.gz")
    p.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="fastdata writer processes (default: the command's own default, usable cores)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three methods (median)")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the webdataset baseline (a quick floor-vs-fastdata check)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for the outputs (default: a temporary folder; the disk the floor measures)",
    )
    return p.parse_args(argv)


def io_floor(archive: Path, sizes: list[int], out: Path) -> float:
    """Seconds to read and gunzip `archive`, then write files of `sizes` bytes into `out`,
    each fsync'd. Nothing but the I/O and the decompression any converter must do."""
    start = time.perf_counter()
    inflate = zlib.decompressobj(wbits=31)  # gzip framing
    with open(archive, "rb", buffering=0) as f:
        while block := f.read(_CHUNK):
            inflate.decompress(block)
    inflate.flush()
    out.mkdir(parents=True)
    fill = bytes(_CHUNK)
    for number, size in enumerate(sizes):
        with open(out / f"{number}.bin", "wb") as f:
            while size > 0:
                f.write(fill if size >= _CHUNK else fill[:size])
                size -= _CHUNK
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def fastdata_cli(archive: Path, out: Path, workers: int | None) -> float:
    """Seconds of `fastdata shard cifar100 ARCHIVE OUT` run as a subprocess (start-up included)."""
    command = [sys.executable, "-m", "fastdata", "shard", "cifar100", str(archive), str(out)]
    command += ["--no-progress"] + (["--workers", str(workers)] if workers else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - start


def baseline_webdataset_png(archive: Path, out: Path) -> int:
    """Single process: open the archive, encode PNG via webdataset's encoder, ShardWriter."""
    import webdataset as wds

    source = open_source("cifar100", archive)
    out.mkdir(parents=True)
    written = 0
    for split, count in source.splits().items():
        with wds.ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=10_000, verbose=0) as sink:
            for i in range(count):
                item = source.item(split, i)
                sink.write({"__key__": f"{split}_{i:08d}", "png": item.pixels, "cls": item.label})
                written += 1
    return written


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def conversion(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Round-robin rounds of fastdata, the floor and the baseline; one row each (medians)."""
    seconds: dict[str, list[float]] = {"floor": [], "fastdata": [], "baseline": []}
    sizes: dict[str, int] = {}
    images = 0
    for r in range(args.rounds):
        out = work / f"fastdata-{r}"
        seconds["fastdata"].append(fastdata_cli(args.archive, out, args.workers))
        files = _files(out)
        sizes["fastdata"] = sum(p.stat().st_size for p in files)
        # Each DALI index starts with "v1.2 <samples>".
        images = sum(int(p.read_text().split(None, 2)[1]) for p in files if p.suffix == ".idx")
        floor_out = work / f"floor-{r}"
        seconds["floor"].append(
            io_floor(args.archive, [p.stat().st_size for p in files], floor_out)
        )
        shutil.rmtree(out)
        shutil.rmtree(floor_out)
        if not args.no_baseline:
            out = work / f"baseline-{r}"
            start = time.perf_counter()
            baseline_webdataset_png(args.archive, out)
            seconds["baseline"].append(time.perf_counter() - start)
            sizes["baseline"] = sum(p.stat().st_size for p in _files(out))
            shutil.rmtree(out)
        done = {k: v[-1] for k, v in seconds.items() if len(v) > r}
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in done.items()))
    names = {
        "floor": "I/O floor: gunzip the archive + write and fsync the same bytes",
        "fastdata": "fastdata shard cifar100 (CLI subprocess, default options)",
        "baseline": "webdataset ShardWriter, PNG, 1 process (baseline)",
    }
    floor = statistics.median(seconds["floor"])
    base = statistics.median(seconds["baseline"]) if seconds["baseline"] else None
    rows = []
    for key, name in names.items():
        if not seconds[key]:
            continue
        median = statistics.median(seconds[key])
        rows.append(
            {
                "method": name,
                "images": images,
                "seconds": round(median, 2),
                "rounds_s": [round(s, 2) for s in seconds[key]],
                "img_per_s": round(images / median),
                "MiB": round(sizes.get(key, sizes["fastdata"]) / 2**20, 1),
                "vs_floor": round(median / floor, 2),
                "speedup_vs_baseline": round(base / median, 2) if base else None,
            }
        )
    return rows


def encoding_tradeoff(archive: Path, n: int = 2000) -> list[dict[str, Any]]:
    from PIL import Image

    source = open_source("cifar100", archive)
    pixels = [source.item("train", i).pixels for i in range(n)]
    rows = []
    for name, fmt, params in (
        ("raw", None, {}),
        ("png", "PNG", {"compress_level": 1}),
        ("jpeg q90", "JPEG", {"quality": 90}),
    ):
        if fmt is None:
            blobs = [p.tobytes() for p in pixels]
            decode = lambda b: np.frombuffer(b, np.uint8).reshape(32, 32, 3)  # noqa: E731
        else:
            blobs = []
            for p in pixels:
                buf = io.BytesIO()
                Image.fromarray(p).save(buf, fmt, **params)
                blobs.append(buf.getvalue())
            decode = lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))  # noqa: E731
        start = time.process_time()
        for b in blobs:
            decode(b)
        cpu_us = (time.process_time() - start) / n * 1e6
        rows.append(
            {
                "encoding": name,
                "bytes_per_sample": round(sum(map(len, blobs)) / n),
                "decode_cpu_us": round(cpu_us, 1),
                "lossless": fmt != "JPEG",
            }
        )
    return rows


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not args.archive.exists():
        raise SystemExit(f"{args.archive} not found: set FASTDATA_DATA_DIR or pass --archive")
    out = results_dir(args.out)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_shard_", dir=args.work) as tmp:
        rows = conversion(args, Path(tmp))
    tables = [
        print_table(
            rows,
            ["method", "images", "seconds", "img_per_s", "MiB", "vs_floor", "speedup_vs_baseline"],
            f"CIFAR-100 (60,000 images) archive -> tar shards, median of {args.rounds} rounds",
        )
    ]
    enc = encoding_tradeoff(args.archive)
    tables.append(
        print_table(
            enc,
            ["encoding", "bytes_per_sample", "decode_cpu_us", "lossless"],
            "Sample encoding for 32x32 images (2,000 CIFAR-100 samples, 1 thread)",
        )
    )
    results = {
        "conversion": rows,
        "encoding": enc,
        "cpu": cpu_description(),
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "target": "fastdata shard within 2x of the I/O floor (vs_floor <= 2), >= 2x baseline",
    }
    save_results("bench_shard", out, results, tables)
    return results


if __name__ == "__main__":
    main(parse_args())
