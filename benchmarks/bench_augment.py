"""Throughput of the device augmentation presets (fastdata.augment) on synthetic uint8 batches.

    python benchmarks/bench_augment.py --cases cifar --threads 1     # CPU, quick
    python benchmarks/bench_augment.py --device cuda                 # every preset on the GPU

Prints one row per (preset, mode) and writes bench_augment.json / .md (with versions, host and git
revision, see benchmarks/common.py) to --out, else $OUT, else benchmarks/results/. On CUDA the timed
region is bracketed by CUDA events after a synchronized warm-up (device time per batch); on CPU it
is wall time. Batches are synthetic: augmentation cost does not depend on pixel values.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from common import print_table, results_dir, save_results  # noqa: I001  (run as a script)

from fastdata.augment import get_preset

# (preset, image_size, input side, default batch size): CIFAR batches arrive at 32x32; "photo"
# batches arrive already decoded and flipped at image_size (normalize only); "photo_device" gets
# full-size fixed images (the device-resident backend).
CASES = {
    "cifar": ("cifar", None, 32, 512),
    "photo": ("photo", 224, 224, 256),
    "photo_device": ("photo_device", 224, 256, 256),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batch-size", type=int, default=None, help="default: per case")
    parser.add_argument("--iters", type=int, default=20, help="timed batches per case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--out", default=None, help="results folder (default $OUT or benchmarks/results)"
    )
    return parser.parse_args(argv)


def _seconds_per_batch(fn, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main(args: argparse.Namespace) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for case in args.cases:
        name, image_size, side, batch_size = CASES[case]
        batch_size = args.batch_size or batch_size
        preset = get_preset(name, image_size=image_size)
        shape = (batch_size, 3, side, side)
        x = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        for train in (True, False):
            seconds = _seconds_per_batch(
                partial(preset.apply, x, train, generator), device, args.iters, args.warmup
            )
            rows.append(
                {
                    "preset": name,
                    "mode": "train" if train else "eval",
                    "input": "x".join(map(str, shape)),
                    "ms_per_batch": round(seconds * 1e3, 3),
                    "images_per_s": round(batch_size / seconds),
                }
            )
    columns = ["preset", "mode", "input", "ms_per_batch", "images_per_s"]
    title = f"fastdata.augment on {device} ({torch.get_num_threads()} CPU threads)"
    table = print_table(rows, columns, title)
    save_results("bench_augment", results_dir(args.out), {"rows": rows}, [table])
    return rows


if __name__ == "__main__":
    main(parse_args())
