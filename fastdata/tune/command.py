"""`fastdata tune OUT`: measure, choose loader settings, and show the throughput they give.

fastdata tune shards/cifar100                   # measurements, choice, reasons, img/s
fastdata tune shards/cifar100 --sweep           # + img/s over num_workers x prefetch_factor
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from fastdata.read import backend_choices
from fastdata.tune import (
    SweepPoint,
    TuneOptions,
    measure_settings,
    sweep,
    tune,
    tuning_spec,
)

__all__ = ["SWEEP_PREFETCH", "SWEEP_WORKERS", "format_sweep", "register", "run"]

SWEEP_WORKERS = (0, 1, 2, 3, 4)
SWEEP_PREFETCH = (1, 2, 4)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tune` subcommand to the `fastdata` command line."""
    p = subparsers.add_parser(
        "tune",
        help="choose num_workers / prefetch_factor from measured core load and sample cost",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("out", help="shard folder (holding manifest.json)")
    p.add_argument("--split", default="train", help="split to measure (default: train)")
    p.add_argument("--batch-size", type=_positive, default=256, help="samples per batch")
    p.add_argument(
        "--backend",
        default="cpu",
        choices=backend_choices(auto=False),  # `fastdata.read.BACKENDS`, read now
        help="the registered backend to size the loader for (default: cpu)",
    )
    p.add_argument("--image-size", type=_positive, default=None, help="output side of photos")
    p.add_argument(
        "--consumer-rate",
        type=float,
        default=None,
        help="samples/s the training step consumes (default: unknown, use every free core)",
    )
    p.add_argument("--sweep", action="store_true", help="also measure workers 0-4 x prefetch 1,2,4")
    p.add_argument("--batches", type=_positive, default=30, help="batches timed per throughput")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `fastdata tune` with parsed arguments; prints the report, returns the exit status."""
    spec = tuning_spec(args.out, args.split, args.batch_size, image_size=args.image_size)
    options = TuneOptions(consumer_rate=args.consumer_rate)
    result = tune(spec, args.backend, options=options)
    print(
        f"fastdata tune {args.out}: split {args.split}, batch {args.batch_size}, backend {args.backend}"
    )
    if result.probe is not None and result.cost is not None:
        print(result.probe.describe())
        print(result.cost.describe())
    settings = result.settings
    print("choice (for training, a core kept for the training loop): " + settings.describe())
    if result.probe is None:
        return 0  # a backend without loader workers (memory, nvjpeg): nothing more to measure
    if result.probe is not None:
        # The loader alone (no training step): the rule without a core kept, then timed
        # candidates (workers, and decode threads for photos), on the same machine reading.
        alone_options = dataclasses.replace(
            options, main_cores=0.0, confirm="all", confirm_batches=args.batches
        )
        alone = tune(spec, args.backend, options=alone_options, probe=result.probe)
        print("loader alone, checked by measurement: " + alone.settings.reasons[-1])
    measured = measure_settings(
        spec,
        settings.num_workers,
        settings.prefetch_factor,
        args.batches,
        decode_threads=settings.decode_threads,
    )
    print(
        f"throughput with it: {measured.samples_per_s:,.0f} img/s over {measured.batches} batches "
        f"(start-up {measured.startup_s:.2f} s){'; ' + '; '.join(measured.notes) if measured.notes else ''}"
    )
    if args.sweep:
        points = sweep(spec, SWEEP_WORKERS, SWEEP_PREFETCH, args.batches)
        print(format_sweep(points, (settings.num_workers, settings.prefetch_factor)))
    return 0


def format_sweep(points: Sequence[SweepPoint], tuned: tuple[int, int] | None = None) -> str:
    """A table of img/s per (num_workers, prefetch_factor), the best marked `*`, the tuned `<`."""
    best = max(points, key=lambda p: p.samples_per_s)
    lines = ["num_workers  prefetch      img/s", "-----------  --------  ---------"]
    for p in points:
        marks = ("*" if p is best else " ") + (" < tuned" if _same(p, tuned) else "")
        prefetch = str(p.prefetch_factor) if p.num_workers else "-"
        lines.append(
            f"{p.num_workers:>11}  {prefetch:>8}  {p.samples_per_s:>9,.0f} {marks}".rstrip()
        )
    lines.append("* best   < the tuned setting")
    return "\n".join(lines)


def _same(point: SweepPoint, tuned: tuple[int, int] | None) -> bool:
    if tuned is None or point.num_workers != tuned[0]:
        return False
    return point.num_workers == 0 or point.prefetch_factor == tuned[1]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value
