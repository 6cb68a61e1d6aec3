"""Photo decoding on the CPU: per-image decoders side by side, and `decode_batch` with threads.

    python benchmarks/bench_decode.py                       # clothing-small train, 224 px RRC
    python benchmarks/bench_decode.py --geometry center     # the evaluation centre crop
    python benchmarks/bench_decode.py --core 1 --images 200 # pinned to one core, quicker
    python benchmarks/bench_decode.py --loader              # + the loader photo suite (below)

First, which DCT scales the crops allow (the share of crops that a scale of 1/2, 1/4, 1/8, or of
M/8, still covers at the output size) and where the region decoder (fastdata's `_jpeg` extension) spends its time (whole
image, the crop's region, and the entropy-decoding floor: `scale_rows`).

Every decoder gets the same JPEGs and the same random-resized-crop boxes (torchvision semantics,
`fastdata.augment.rrc_params`) and returns the 224 x 224 RGB crop:

- Pillow full decode + `resize(box=...)`: what a per-sample Pillow DataLoader does;
- fastdata, Pillow-SIMD path: draft mode (DCT scale 1/2..1/8 when it covers the box) + boxed resize
  (`decode_image(..., roi=False)`, the decoder before region decoding);
- fastdata: `decode_image` (crop-region decode by fastdata's libjpeg-turbo extension, or the
  draft path where a DCT-scaled whole image has fewer pixels);
- simplejpeg / pyvips, when installed: whole decode at the DCT scale that covers the box (they
  cannot decode a region) + Pillow-SIMD boxed resize / libvips shrink-on-load + crop + resize.

Per image: wall time and the process's CPU time (all threads); on a busy machine the CPU figure is the one to compare. Then `decode_batch` over
batches of 64 with 1, 2, ... threads (threads only add
throughput where a core is free).

--loader adds the photo suite of bench_loader.py (clothing-small train, 224 px RRC + flip +
normalize, batch 64, 2 workers): its per-sample Pillow DataLoader against fastdata cpu, with region
decoding, with it off (the decoder before), and with decode threads; img/s and the CPU seconds per
image of the main process and its workers together (the figure to compare when other processes
load the machine; 2 cores / that cost is the rate on an otherwise idle 2-core machine). Writes bench_decode.json / .md (versions, host, git
revision) to --out, else $OUT, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import io
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import print_table, results_dir, save_results  # noqa: I001  (run as a script)
from fastdata_pipelines.env import data_dir
from PIL import Image

from fastdata import WorkerSettings
from fastdata._util import threads as _threads
from fastdata.augment import rrc_params
from fastdata.read.decoders import image as decode
from fastdata.read.decoders.image import Geometry, decode_batch, decode_image, jpeg_region_decoder

Box = tuple[int, int, int, int]  # (left, top, right, bottom)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="folder with clothing-small/ (default: shared)")
    p.add_argument("--split", default="train")
    p.add_argument("--images", type=int, default=400, help="JPEGs to decode per decoder")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--geometry", default="rrc", choices=["rrc", "center"])
    p.add_argument("--repeats", type=int, default=5, help="passes per decoder (best is kept)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="decode_batch threads")
    p.add_argument("--core", type=int, default=None, help="pin the per-image runs to this core")
    p.add_argument("--loader", action="store_true", help="also time the loader photo suite")
    p.add_argument("--loader-batches", type=int, default=36, help="timed batches per loader")
    p.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    return p.parse_args(argv)


def load_jpegs(args: argparse.Namespace) -> list[bytes]:
    root = Path(args.data) if args.data else data_dir()
    files = sorted((root / "clothing-small" / args.split).glob("*/*.jpg"))[: args.images]
    if not files:
        raise SystemExit(f"no JPEGs under {root / 'clothing-small' / args.split}: pass --data")
    return [f.read_bytes() for f in files]


def crop_box(data: bytes, geometry: Geometry, seed: int) -> Box:
    """The box `decode_image` draws for this image and seed (same generator, same order)."""
    width, height = Image.open(io.BytesIO(data)).size
    if geometry.kind == "rrc":
        top, left, h, w = rrc_params(height, width, rng=np.random.default_rng(seed))
    else:
        h = w = max(1, round(min(width, height) / geometry.resize_ratio))
        top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def pillow_full(data: bytes, box: Box, size: int) -> np.ndarray:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return np.asarray(image.resize((size, size), Image.BILINEAR, box=box))


def dct_factor(box: Box, size: int) -> int:
    """The DCT scale denominator (1, 2, 4, 8) that still covers the box at `size`."""
    reduce = max(1.0, min(box[2] - box[0], box[3] - box[1]) / size)
    return 2 ** min(3, int(math.log2(reduce)))


def candidates(geometry: Geometry) -> dict[str, Callable[[bytes, Box, int, int], np.ndarray]]:
    """name -> decode(data, box, size, seed); optional libraries only when importable."""
    found: dict[str, Callable[[bytes, Box, int, int], np.ndarray]] = {
        "Pillow full decode + resize(box)": lambda d, b, s, seed: pillow_full(d, b, s),
        "fastdata, Pillow-SIMD draft path": lambda d, b, s, seed: decode_image(
            d, geometry, np.random.default_rng(seed), roi=False
        ),
    }
    if jpeg_region_decoder() is not None:
        found["fastdata decode_image (region decode)"] = lambda d, b, s, seed: decode_image(
            d, geometry, np.random.default_rng(seed)
        )
    try:
        import simplejpeg

        def simple(data: bytes, box: Box, size: int, seed: int) -> np.ndarray:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            f = dct_factor(box, size)  # other factors (n/8) have no SIMD IDCT: slower
            pixels = simplejpeg.decode_jpeg(data, min_height=-(-h // f), min_width=-(-w // f))
            sy, sx = pixels.shape[0] / h, pixels.shape[1] / w
            scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            return np.asarray(Image.fromarray(pixels).resize((size, size), box=scaled))

        found[f"simplejpeg {simplejpeg.__version__} (scaled whole decode)"] = simple
    except ImportError:
        pass
    try:
        import pyvips

        def vips(data: bytes, box: Box, size: int, seed: int) -> np.ndarray:
            f = dct_factor(box, size)
            image = pyvips.Image.new_from_buffer(data, "", shrink=f, access="sequential")
            x0, y0 = box[0] // f, box[1] // f
            crop = image.crop(
                x0, y0, max(1, (box[2] - box[0]) // f), max(1, (box[3] - box[1]) // f)
            )
            crop = crop.resize(size / crop.width, vscale=size / crop.height, kernel="linear")
            return crop.numpy()

        found[f"pyvips {pyvips.__version__} (shrink-on-load + crop)"] = vips
    except (ImportError, OSError):
        pass
    return found


def one_pass(fn, jpegs, boxes, size: int) -> tuple[float, float]:
    """(wall s, CPU s) of decoding every image once."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i, data in enumerate(jpegs):
        fn(data, boxes[i], size, i)
    return time.perf_counter() - w0, time.process_time() - c0


def per_image_rows(args, jpegs, geometry) -> list[dict]:
    boxes = [crop_box(d, geometry, i) for i, d in enumerate(jpegs)]
    factors = [dct_factor(b, args.size) for b in boxes]
    print(f"DCT scale that covers the box: { {f'1/{f}': factors.count(f) for f in set(factors)} }")
    decoders = candidates(geometry)
    best = {name: (math.inf, math.inf) for name in decoders}
    for fn in decoders.values():  # warm-up
        one_pass(fn, jpegs[:20], boxes[:20], args.size)
    # Round-robin passes, best of each: a machine whose load changes hurts every decoder alike.
    for _ in range(args.repeats):
        for name, fn in decoders.items():
            wall, cpu = one_pass(fn, jpegs, boxes, args.size)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    rows = [
        {
            "decoder": name,
            "ms_per_image": w / len(jpegs) * 1e3,
            "cpu_ms_per_image": c / len(jpegs) * 1e3,
        }
        for name, (w, c) in best.items()
    ]
    base = rows[0]["cpu_ms_per_image"]
    for row in rows:
        row["speedup_cpu"] = base / row["cpu_ms_per_image"]
    return rows


def scale_rows(args, jpegs, geometry) -> list[dict]:
    """Which DCT scales the crops allow, and where a region decode's CPU time goes.

    A crop can be decoded at DCT scale s (libjpeg-turbo: 1/2, 1/4, 1/8 with SIMD IDCTs;
    TurboJPEG 3 also M/8, M = 1..7, in plain C) without upscaling when s * (its box's shorter
    side) >= the output side. Per scale set: the share of the crops that one of its scales < 1
    covers. Then the region decoder's CPU time per image (one thread) for the whole
    image, the crop's region, and a 16 x 16 region at the bottom-right corner: libjpeg-turbo
    entropy-decodes every row above a region, so that last one is the floor no DCT scale or
    region lowers.
    """
    boxes = [crop_box(d, geometry, i) for i, d in enumerate(jpegs)]
    sides = np.array([min(b[2] - b[0], b[3] - b[1]) for b in boxes]) / args.size
    rows = [
        {"measure": "crops a scale of 1/2, 1/4, 1/8 covers", "value": float(np.mean(sides >= 2))}
    ]
    for m in range(7, 0, -1):
        share = float(np.mean(sides * m / 8 >= 1))
        rows.append({"measure": f"crops a scale <= {m}/8 covers", "value": share})
    rows.append(
        {"measure": "crops smaller than the output (upscaled)", "value": float(np.mean(sides < 1))}
    )
    decoder = decode.region_decoder()
    if decoder is None:
        return rows
    streams = [decoder.open(d) for d in jpegs]
    whole = [(s, (0, 0, *s.size)) for s in streams]
    corner = [(s, (s.size[0] - 16, s.size[1] - 16, *s.size)) for s in streams]
    jobs = {
        "region decoder CPU ms/image: whole image": whole,
        "region decoder CPU ms/image: the crop's region": list(zip(streams, boxes, strict=True)),
        "region decoder CPU ms/image: 16 x 16 corner (entropy decoding)": corner,
    }
    for name, items in jobs.items():
        best = math.inf
        for _ in range(args.repeats):
            start = time.process_time()
            for stream, box in items:
                decoder.region(stream, box)
            best = min(best, time.process_time() - start)
        rows.append({"measure": name, "value": best / len(items) * 1e3})
    return rows


def batch_rows(args, jpegs, geometry) -> list[dict]:
    """decode_batch over the images in batches, wall time, per thread count."""
    n = args.batch_size
    batches = [jpegs[i : i + n] for i in range(0, len(jpegs) - n + 1, n)] or [jpegs]
    rows = []
    for threads in args.threads:
        decode_batch(batches[0], geometry, [np.random.default_rng(i) for i in range(n)], threads)
        wall = cpu = math.inf
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            for b, batch in enumerate(batches):
                rngs = [np.random.default_rng([b, i]) for i in range(len(batch))]
                decode_batch(batch, geometry, rngs, threads)
            wall = min(wall, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - start_cpu)
        images = sum(len(b) for b in batches)
        rows.append(
            {
                "threads": threads,
                "batch": n,
                "img_per_s": images / wall,
                "cpu_ms_per_image": cpu / images * 1e3,
            }
        )
    return rows


# ------------------------------------------------------------------ --loader


def _cpu_by_pid() -> dict[int, float]:
    """CPU seconds of this process and each of its children (DataLoader workers)."""
    import psutil

    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            out[proc.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


def _timed_loader(loader, consume, warmup: int, count: int) -> dict:
    """img/s and CPU ms per image (all processes) over `count` batches after `warmup`."""

    def endless():
        while True:
            yield from loader

    batches = endless()
    for _ in range(warmup):
        consume(next(batches))
    cpu0, wall0, images = _cpu_by_pid(), time.perf_counter(), 0
    for _ in range(count):
        images += consume(next(batches))
    cpu1, wall = _cpu_by_pid(), time.perf_counter() - wall0
    # Processes present at both readings (idle workers of earlier loaders may exit meanwhile).
    cpu = sum(cpu1[pid] - cpu0[pid] for pid in cpu0.keys() & cpu1.keys())
    return {"img_per_s": images / wall, "cpu_ms_per_image": cpu / images * 1e3, "images": images}


def loader_rows(args: argparse.Namespace) -> list[dict]:
    """The photo suite of bench_loader.py, plus fastdata cpu variants (see the docstring)."""
    import tempfile

    import bench_loader as bl
    from baselines import PhotoFolder
    from torch.utils.data import DataLoader

    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources import open_source

    suite = bl.parse_args(["--data", str(args.data or data_dir())])
    root = suite.data / "clothing-small"
    warmup, count, b = bl._warmup(suite), args.loader_batches, 64

    def pillow() -> dict:
        data = PhotoFolder(root / "train", 224)
        loader = DataLoader(data, b, shuffle=True, drop_last=True, **bl._loader_kwargs(suite))
        return _timed_loader(loader, lambda x: x[0].shape[0], warmup, count)

    def fastdata(
        workers: int = suite.workers, region: bool = True, decode_threads: int = 1
    ) -> dict:
        dm = ShardDataModule(
            shards,
            batch_size=b,
            backend="cpu",
            image_size=224,
            workers=WorkerSettings(
                num_workers=workers, prefetch_factor=suite.prefetch, decode_threads=decode_threads
            ),
        )
        dm.setup("fit")
        real = decode.jpeg_stream
        if not region:  # forked workers inherit the switch: Pillow-SIMD's draft path only
            decode.jpeg_stream = lambda data: None
        try:
            loader = dm.train_dataloader()
            consume = lambda x: dm.on_after_batch_transfer(x, 0)[0].shape[0]  # noqa: E731
            return _timed_loader(loader, consume, warmup, count)
        finally:
            decode.jpeg_stream = real

    runs = {
        "Pillow per-sample DataLoader": pillow,
        "fastdata cpu (region decode)": fastdata,
        "fastdata cpu, region decoding off (before)": lambda: fastdata(region=False),
        "fastdata cpu, decode_threads=2": lambda: fastdata(decode_threads=2),
        "fastdata cpu, 1 worker, decode_threads=2": lambda: fastdata(1, decode_threads=2),
    }
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as work:
        shards = Path(work) / "clothing"
        write_shards(open_source("folder", root), shards, ShardOptions(progress=False))
        rows = []
        for name, run in runs.items():
            rows.append({"method": name, **run()})
            # Shut the finished loader's workers down here: collected later, in a forked worker
            # of the next loader, its iterator fails "can only test a child process".
            gc.collect()
            print(f"  {name}: {rows[-1]['img_per_s']:.0f} img/s", flush=True)
    base = rows[0]
    for row in rows:
        row["vs_pillow"] = row["img_per_s"] / base["img_per_s"]
        row["vs_pillow_cpu"] = base["cpu_ms_per_image"] / row["cpu_ms_per_image"]
        row["idle_2core_img_per_s"] = 2e3 / row["cpu_ms_per_image"]
    return rows


def main(args: argparse.Namespace) -> dict:
    jpegs = load_jpegs(args)
    geometry = Geometry(args.geometry, size=args.size, flip_p=0.5 if args.geometry == "rrc" else 0)
    print(f"{len(jpegs)} JPEGs; region decoder: {jpeg_region_decoder() or 'none'}")
    print(f"load average at start: {os.getloadavg()}")
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if args.core is not None and affinity is not None:
        os.sched_setaffinity(0, {args.core})
    scales = scale_rows(args, jpegs, geometry)
    single = per_image_rows(args, jpegs, geometry)
    if args.core is not None and affinity is not None:
        os.sched_setaffinity(0, affinity)
    batched = batch_rows(args, jpegs, geometry)
    title = f"per image, {args.geometry} {args.size} px, clothing-small {args.split}"
    tables = [
        print_table(scales, ["measure", "value"], "DCT scales the crops allow; decode cost"),
        print_table(single, ["decoder", "ms_per_image", "cpu_ms_per_image", "speedup_cpu"], title),
        print_table(batched, ["threads", "batch", "img_per_s", "cpu_ms_per_image"], "decode_batch"),
    ]
    results = {"args": vars(args), "region_decoder": jpeg_region_decoder()}
    results |= {
        "scales": scales,
        "per_image": single,
        "decode_batch": batched,
        "pool": repr(_threads._pool),
    }
    if args.loader:
        rows = loader_rows(args)
        columns = ["method", "img_per_s", "vs_pillow", "cpu_ms_per_image", "vs_pillow_cpu"]
        title = "loader photo suite: clothing-small train, 224 px RRC + flip + normalize, batch 64"
        tables.append(print_table(rows, [*columns, "idle_2core_img_per_s"], title))
        results["loader"] = rows
    save_results("bench_decode", results_dir(args.out), results, tables)
    return results


if __name__ == "__main__":
    main(parse_args())
