"""One peer measurement in the peers' venv; `bench_peers.py` starts it and reads its JSON.

    .venv-peers/bin/python benchmarks/peers_run.py convert litdata cifar --source ARCHIVE \
        --work DIR --result FILE
    .venv-peers/bin/python benchmarks/peers_run.py load streaming photo --mode engine \
        --work DIR --result FILE

`convert` writes `<work>/<library>-<dataset>/<split>` and times it (the call only, not the
interpreter's start-up or imports, as fastdata's conversion is timed); `load` reads the train
split written by `convert` and times whole epochs (see `peers_common.time_epochs`). The result
file holds the figures and this venv's library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import peers_litdata
import peers_streaming
from peers_common import threads_note, time_conversion, time_epochs, versions

LIBRARIES = {"litdata": peers_litdata, "streaming": peers_streaming}
VERSIONS = ("torch", "torchvision", "litdata", "mosaicml-streaming", "pillow", "numpy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=["convert", "load"])
    p.add_argument("library", choices=sorted(LIBRARIES))
    p.add_argument("dataset", choices=["cifar", "photo"])
    p.add_argument("--source", type=Path, help="convert: CIFAR-100 archive or clothing folder")
    p.add_argument("--work", type=Path, required=True, help="folder for datasets and caches")
    p.add_argument("--result", type=Path, required=True, help="JSON file to write")
    p.add_argument("--mode", choices=["readme", "engine"], default="readme")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="loader / conversion processes")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-batches", type=int, default=None, help="smoke runs: cut epochs short")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    library = LIBRARIES[args.library]
    data = args.work / f"{args.library}-{args.dataset}"
    if args.task == "convert":
        if args.source is None:
            raise SystemExit("peers_run.py convert: give --source (the archive or folder)")
        shutil.rmtree(data, ignore_errors=True)  # a partial earlier run must not be appended to
        return time_conversion(
            lambda: library.convert(args.dataset, args.source, data, args.workers)
        )
    if not (data / "train").is_dir():
        raise SystemExit(f"peers_run.py load: {data / 'train'} is missing; run `convert` first")
    cache = args.work / f"cache-{args.library}-{args.dataset}-{args.mode}"
    shutil.rmtree(cache, ignore_errors=True)  # the first epoch starts cold, every time
    make_loader, consume = library.loader(
        args.dataset, data, cache, args.mode, args.batch_size, args.workers
    )
    epochs = time_epochs(make_loader, consume, args.epochs, args.max_batches)
    return {"epochs": epochs}


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI query from a benchmark
    result = run(args) | {"versions": versions(VERSIONS), **threads_note()}
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
