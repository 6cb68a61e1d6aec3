"""Cost of calling a user transform once per image (`BatchTransform`, the default) against once
per batch (``per_sample=False``), on a synthetic uint8 batch.

    python benchmarks/bench_per_image.py                       # 256 x 3 x 32 x 32, CPU, 1 thread
    python benchmarks/bench_per_image.py --device cuda --batch 256 --side 224

Two callables written as a torchvision v2 transform is (one draw of torch's global generator per
call): a flip with p = 0.5, and a pad-4 random crop + flip + brightness. Prints ms per batch and
us per image (median of `--reps` timed calls after a warm-up; CUDA: synchronized wall time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fastdata.augment import BatchTransform


def coin_flip(x: torch.Tensor) -> torch.Tensor:
    """Mirror with p = 0.5 (one draw per call)."""
    return x.flip(-1) if bool(torch.rand(1) < 0.5) else x


def crop_flip_jitter(x: torch.Tensor) -> torch.Tensor:
    """Pad-4 random crop, flip with p = 0.5, brightness in [0.8, 1.2] (one draw set per call)."""
    h, w = x.shape[-2:]
    dy, dx = torch.randint(0, 9, (2,)).tolist()
    x = F.pad(x, (4, 4, 4, 4))[..., dy : dy + h, dx : dx + w]
    if bool(torch.rand(1) < 0.5):
        x = x.flip(-1)
    return (x.float() * float(torch.empty(1).uniform_(0.8, 1.2))).clamp_(0, 255)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randint(0, 256, (args.batch, 3, args.side, args.side), dtype=torch.uint8)
    x = x.to(device)
    generator = torch.Generator()
    for fn in (coin_flip, crop_flip_jitter):
        for per_sample in (False, True):
            op = BatchTransform(fn, per_sample=per_sample)
            times = []
            for rep in range(args.reps + 3):
                start = time.perf_counter()
                op(x, None, generator.manual_seed(rep))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep >= 3:  # warm-up
                    times.append(time.perf_counter() - start)
            t = statistics.median(times)
            print(
                f"{fn.__name__:17s} per_sample={per_sample!s:5s} {t * 1e3:8.2f} ms/batch "
                f"{t / args.batch * 1e6:7.1f} us/image"
            )


if __name__ == "__main__":
    main()
