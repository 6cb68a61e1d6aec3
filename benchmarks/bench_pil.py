"""What the environment's PIL (Pillow or Pillow-SIMD) changes in fastdata's own work, one thread.

    python benchmarks/bench_pil.py [--out DIR] [--repeats 3]

Run it once in each environment (one with Pillow, one with Pillow-SIMD; the JSON's
`environment.pil` says which ran) and compare the rows. In-process and single-threaded, so that
the figures are the PIL paths' own cost, not the loader's process start-up:
  - shard a folder: `write_shards` of clothing-small (1,514 JPEGs kept as they are; PIL reads each
    header and computes the channel statistics), one writer process;
  - photos, region: clothing-small train JPEGs, 224 px random-resized-crop + flip through
    `decode_image` (the crop's region decoded by fastdata's libjpeg-turbo extension, resized
    by torch: PIL only for the flip);
  - photos, PIL: the same with `roi=False` (PIL's draft-mode decode and resize: the path where no
    region decoder is available);
  - PNG samples: 2,000 CIFAR-100 images as PNG (the bytes of a PNG shard), decoded whole by PIL;
  - Pillow per-sample: `benchmarks/baselines.PhotoFolder`'s items (the baseline of
    `bench_loader.py`'s photo suite: full decode, crop-resize, flip, to-tensor), in-process.
Each row is the pass of least CPU time of `--repeats` (CPU time: see `best_rate`); torch runs
one thread, as in a loader worker.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from baselines import PhotoFolder  # noqa: I001  (run as a script)
from common import print_table, results_dir, save_results
from fastdata_pipelines.env import data_dir
from PIL import Image

from fastdata.read.decoders.image import Geometry, decode_image
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=data_dir())
    p.add_argument("--repeats", type=int, default=3, help="passes per row (the best counts)")
    p.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    return p.parse_args(argv)


def best_rate(items: int, run: Callable[[], object], repeats: int) -> dict[str, Any]:
    """Items per CPU second of the cheapest of `repeats` calls of `run` (each handles `items`).

    CPU time of this process (every row runs in it, on one thread), not wall time: on a shared
    machine the wall time of the same pass varied 3x with the other processes' load; the CPU
    time much less. The wall time of that pass is kept beside it.
    """
    passes = []
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        run()
        passes.append((time.process_time() - cpu, time.perf_counter() - wall))
    cpu_s, wall_s = min(passes)
    return {
        "items": items,
        "cpu_s": round(cpu_s, 3),
        "wall_s": round(wall_s, 3),
        "per_cpu_s": round(items / cpu_s, 1),
    }


def shard_folder(root: Path, work: Path) -> None:
    out = work / "shards"
    shutil.rmtree(out, ignore_errors=True)
    write_shards(open_source("folder", root), out, ShardOptions(workers=1, progress=False))


def png_samples(archive: Path, count: int) -> list[bytes]:
    """`count` CIFAR-100 training images encoded as PNG (as `encoding="png"` stores them)."""
    source = open_source("cifar100", archive)
    samples = []
    for i in range(count):
        buf = io.BytesIO()
        Image.fromarray(source.item("train", i).pixels).save(buf, format="PNG")
        samples.append(buf.getvalue())
    return samples


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # One torch thread, as in a DataLoader worker: the resize and to-tensor steps must not race
    # the other cores' load (on a busy 2-core machine, 2 threads made them ~3x slower).
    torch.set_num_threads(1)
    photos = PhotoFolder(args.data / "clothing-small" / "train", 224)
    jpegs = [path.read_bytes() for path, _ in photos.items]
    pngs = png_samples(args.data / "cifar-100-python.tar.gz", 2000)
    rrc = Geometry(kind="rrc", size=224, flip_p=0.5)
    whole = Geometry()

    def decode_all(payloads: list[bytes], geometry: Geometry, roi: bool) -> None:
        rng = np.random.default_rng(0)
        for data in payloads:
            decode_image(data, geometry, rng, roi=roi)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pil_") as tmp:
        work = Path(tmp)
        runs: dict[str, tuple[int, Callable[[], object]]] = {
            "shard a folder (clothing-small, 1 writer)": (
                1514,
                lambda: shard_folder(args.data / "clothing-small", work),
            ),
            "photos, region decode (224 px rrc)": (
                len(jpegs),
                lambda: decode_all(jpegs, rrc, True),
            ),
            "photos, PIL decode (224 px rrc, roi=False)": (
                len(jpegs),
                lambda: decode_all(jpegs, rrc, False),
            ),
            "PNG samples (CIFAR 32x32, whole)": (len(pngs), lambda: decode_all(pngs, whole, True)),
            "Pillow per-sample (bench_loader's baseline)": (
                len(photos),
                lambda: [photos[i] for i in range(len(photos))],
            ),
        }
        for name, (items, run) in runs.items():
            rows.append({"method": name, **best_rate(items, run, args.repeats)})
    from fastdata import pil_info

    title = f"fastdata's PIL paths, one thread, on {pil_info().describe()}"
    table = print_table(rows, ["method", "items", "cpu_s", "wall_s", "per_cpu_s"], title)
    save_results("bench_pil", results_dir(args.out), {"rows": rows}, [table])


if __name__ == "__main__":
    main()
