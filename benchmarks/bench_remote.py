"""First and second epoch over HTTP from a loopback server vs local disk, cache smaller than the data.

    python benchmarks/bench_remote.py [--out DIR] [--cache-fraction 0.4] [--encoding raw]

CIFAR-100 (../shared/data, or $FASTDATA_DATA_DIR) is sharded into a temporary folder (train split,
5,000 images a shard), then one epoch of the train split is read in the training plan's order
(`fastdata.read.plan.epoch_order`, seed 0, epochs 0 and 1) through `ShardReader` + the CPU
decoder (`decode_raw` / `decode_image`), single process:
- local: the shard folder on disk;
- http, small cache: Python's ThreadingHTTPServer serving the folder on 127.0.0.1, read through a
  `ShardCache` of `--cache-fraction` of the train split's bytes (prefetch 2 shards ahead), so the
  second epoch must download again what was evicted;
- http, cache fits: the same with a cache larger than the dataset (the second epoch fetches 0 B).
Reported per epoch: images, seconds, img/s, bytes fetched over HTTP, shard downloads. Reading
goes through ShardReader + decode, not the DataModule (whose cache_dir/cache_limit wiring is the
lead's part of issue 10).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
from common import print_table, results_dir, save_results  # noqa: I001  (run as a script)
from fastdata_pipelines.env import data_dir

from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.read.decoders.image import Geometry, decode_image, decode_raw
from fastdata.read.plan import epoch_order, rows_to_refs
from fastdata.read.shardio import ShardReader
from fastdata.remote import ShardCache
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        pass


def serve(folder: Path) -> tuple[ThreadingHTTPServer, str]:
    """Python's HTTP server on a free loopback port, serving `folder` from a daemon thread."""
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}"


def read_epoch(manifest: Manifest, epoch: int, cache: ShardCache | None) -> dict[str, Any]:
    """Read and decode the train split once in the plan's order; time it."""
    split = manifest.split("train")
    sizes = [s.num_samples for s in split.shards]
    refs = rows_to_refs(epoch_order(sizes, 0, epoch, shuffle=True), sizes)
    reader = ShardReader(manifest, "train", max_open=1, cache=cache)
    shape = tuple(split.raw_shape) if split.encoding == "raw" else None
    ext = "rgb" if shape else ("jpg" if split.encoding == "jpeg" else "png")
    geometry, rng = Geometry("none"), np.random.default_rng(0)
    before = (cache.stats.bytes_fetched, cache.stats.downloads) if cache else (0, 0)
    start = time.perf_counter()
    if cache is not None:
        order = [split.shards[int(n)] for n in dict.fromkeys(refs[:, 0].tolist())]
        cache.prefetch(manifest, order, ahead=2)
    checksum = 0
    for shard, index in refs.tolist():
        data = reader.sample(shard, index, (ext,))[ext]
        pixels = decode_raw(data, shape) if shape else decode_image(data, geometry, rng)
        checksum += int(pixels[0, 0, 0])
    seconds = time.perf_counter() - start
    reader.close()
    fetched = (
        (cache.stats.bytes_fetched - before[0], cache.stats.downloads - before[1])
        if cache
        else (0, 0)
    )
    return {
        "epoch": epoch + 1,
        "images": len(refs),
        "seconds": round(seconds, 2),
        "img_per_s": round(len(refs) / seconds),
        "MB_fetched": round(fetched[0] / 1e6, 1),
        "downloads": fetched[1],
        "checksum": checksum,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--cache-fraction", type=float, default=0.4, help="small cache / data")
    parser.add_argument("--encoding", default="raw", choices=["raw", "png", "jpeg"])
    return parser.parse_args()


def main(args: argparse.Namespace) -> None:
    archive = data_dir() / "cifar-100-python.tar.gz"
    if not archive.exists():
        raise SystemExit(f"{archive} not found: set FASTDATA_DATA_DIR to the shared data folder")
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = None
    try:
        options = ShardOptions(max_count=5000, workers=2, encoding=args.encoding, progress=False)
        write_shards(open_source("cifar100", str(archive)), work / "shards", options)
        local = load_manifest(work / "shards")
        data_bytes = sum(s.bytes for s in local.split("train").shards)
        server, url = serve(work / "shards")
        remote = load_manifest(url)
        rows = [
            {"reader": "local disk", "cache_MB": None, **read_epoch(local, e, None)} for e in (0, 1)
        ]
        for name, limit in (
            ("http, small cache", int(args.cache_fraction * data_bytes)),
            ("http, cache fits", 2 * data_bytes),
        ):
            cache = ShardCache(work / f"cache-{len(rows)}", limit)
            for epoch in (0, 1):
                row = read_epoch(remote, epoch, cache)
                rows.append({"reader": name, "cache_MB": round(limit / 1e6), **row})
        columns = [
            "reader",
            "cache_MB",
            "epoch",
            "images",
            "seconds",
            "img_per_s",
            "MB_fetched",
            "downloads",
        ]
        title = (
            f"CIFAR-100 train ({args.encoding}, {data_bytes / 1e6:.0f} MB in "
            f"{len(local.split('train').shards)} shards), ShardReader + decode, 1 process"
        )
        table = print_table(rows, columns, title)
        save_results(
            "bench_remote", results_dir(args.out), {"rows": rows, "data_bytes": data_bytes}, [table]
        )
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(parse_args())
