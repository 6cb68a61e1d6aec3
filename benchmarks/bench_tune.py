"""Does `fastdata.tune` pick a loader setting close to the best one, idle and under load?

For CIFAR-100 (raw pixels, CPU backend) and clothing-small (JPEG photos, 224 px crops), on an
idle machine and while a busy-loop process keeps core 0 busy, this measures:

- the setting `tune` chooses (and why) and its steady-state throughput;
- the throughput of every num_workers in {0,1,2,3,4} x prefetch_factor in {1,2,4};
- tuned / best, and whether the choice changed under load. The sweep's best is the largest of
  15 noisy timings, so the target ratio (>= 0.9) compares the tuned setting and the sweep's best
  re-timed in turn `--rounds` times (medians; 1 when the tuner chose the sweep's best setting
  itself); the first-timed ratio is reported beside it.

The sweep times the loader alone: the main process only receives batches, it runs no training
step. So the "tuned" setting compared with the sweep is sized for that consumer
(`TuneOptions(main_cores=0, confirm="all")`: the rule, then the fastest of a few
load-dependent (workers, decode threads) candidates); the setting a training run gets (one core
kept for the training loop, decode threads timed for photos: what
`ShardDataModule(workers=WorkerSettings(num_workers="auto", prefetch_factor="auto",
decode_threads="auto"))` asks `fastdata.lightning.runtime.auto_settings` for) is
reported beside it. Settings print as (workers, prefetch, decode threads). "idle"
means no load added by the benchmark; the load other processes put on the machine is measured
and printed (column "others").

    python benchmarks/bench_tune.py --quick                  # smoke run, well under a minute
    python benchmarks/bench_tune.py --out results/bench_tune.json   # full run (minutes)

Shards are written to a temporary folder from the real data in $FASTDATA_DATA_DIR
(default ../shared/data); a dataset that is absent there is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common import environment  # noqa: I001  (run as a script: benchmarks/ is on sys.path)
from fastdata_pipelines.env import data_dir

from fastdata.read.base import LoaderSpec
from fastdata.tune import (
    LoaderSettings,
    SweepPoint,
    TuneOptions,
    measure_settings,
    sweep,
    tune,
    tuning_spec,
)
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from fastdata.write.sources.base import Source, SourceItem


@dataclass(frozen=True)
class Dataset:
    """One benchmark dataset: where it is, how to shard it, the batch it is read with."""

    name: str
    kind: str  # open_source kind
    path: str  # relative to the data folder
    batch_size: int
    quick_batch_size: int
    quick_samples: int  # training samples kept by --quick
    batches: int  # batches timed per setting: ~1 s of loading (less is timed mostly by noise)
    image_size: int | None = None


DATASETS = {
    "cifar100": Dataset("cifar100", "cifar100", "cifar-100-python.tar.gz", 256, 64, 2048, 160),
    "clothing": Dataset("clothing", "folder", "clothing-small", 32, 16, 160, 40, image_size=224),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--quick", action="store_true", help="small subsets and grid: a smoke run")
    p.add_argument(
        "--batches", type=int, default=None, help="batches timed per setting (default: ~1 s)"
    )
    p.add_argument("--workers", type=int, nargs="+", default=None, help="sweep num_workers")
    p.add_argument("--prefetch", type=int, nargs="+", default=None, help="sweep prefetch_factor")
    p.add_argument("--window", type=float, default=None, help="tune's load window (s)")
    p.add_argument(
        "--rounds", type=int, default=None, help="head-to-head re-timings of tuned and best"
    )
    p.add_argument("--out", type=Path, default=Path("results/bench_tune.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.batches = args.batches or 4
    args.workers = tuple(args.workers or ((0, 1, 2) if args.quick else (0, 1, 2, 3, 4)))
    args.prefetch = tuple(args.prefetch or ((1, 2) if args.quick else (1, 2, 4)))
    args.window = args.window or (0.2 if args.quick else 0.5)
    args.rounds = args.rounds or (1 if args.quick else 5)
    return args


# ---------------------------------------------------------------------------------------------
# Data: shards in a temporary folder (a prefix of the training split with --quick)
# ---------------------------------------------------------------------------------------------


class _TrainPrefix:
    """The first `n` samples of a source's training split (enough for a smoke run)."""

    def __init__(self, source: Source, n: int) -> None:
        self.source, self.n = source, n
        self.kind, self.classes = source.kind, source.classes

    def splits(self) -> dict[str, int]:
        return {"train": min(self.n, self.source.splits()["train"])}

    def item(self, split: str, index: int) -> SourceItem:
        return self.source.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        return {**self.source.fingerprint(), "train_prefix": self.n}


def make_shards(ds: Dataset, quick: bool, tmp: Path) -> Path | None:
    path = data_dir() / ds.path
    if not path.exists():
        print(f"{ds.name}: skipped, {path} is absent (set FASTDATA_DATA_DIR)")
        return None
    source: Any = open_source(ds.kind, path)
    if quick:
        source = _TrainPrefix(source, ds.quick_samples)
    out = tmp / ds.name
    start = time.perf_counter()
    write_shards(source, out, ShardOptions(max_count=1024, progress=False))
    print(f"{ds.name}: shards written in {time.perf_counter() - start:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------
# Load: a busy-loop process pinned to core 0
# ---------------------------------------------------------------------------------------------


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


@contextmanager
def busy_core(core: int) -> Iterator[None]:
    """Keep `core` busy with another process for the duration of the block."""
    proc = mp.get_context("fork").Process(target=_spin, args=(core,), daemon=True)
    proc.start()
    time.sleep(0.3)  # let the load show in the next probe window
    try:
        yield
    finally:
        proc.terminate()
        proc.join()


@contextmanager
def idle() -> Iterator[None]:
    yield


# ---------------------------------------------------------------------------------------------
# Measure
# ---------------------------------------------------------------------------------------------


def run_scenario(spec: LoaderSpec, args: argparse.Namespace, n_batches: int) -> dict[str, Any]:
    """Tune, sweep, compare. The sweep times the loader alone, with no training step in the main
    process, so the tuned setting it is compared with is sized with main_cores=0; the setting a
    training run would get (one core kept for the training loop) is reported beside it. All
    three choices read the same probe of the machine."""
    options = TuneOptions(window_s=args.window, n_batches=8, confirm_batches=n_batches)
    training = tune(spec, options=replace(options, confirm="threads"))
    probe = training.probe
    assert probe is not None and training.cost is not None
    alone = replace(options, main_cores=0.0)
    rule_only = tune(spec, options=alone, probe=probe).settings
    loader_only = tune(spec, options=replace(alone, confirm="all"), probe=probe).settings
    points = sweep(spec, args.workers, args.prefetch, n_batches)
    best = max(points, key=lambda p: p.samples_per_s)
    tuned_rate = _rate(spec, points, loader_only, n_batches)
    h2h = head_to_head(spec, loader_only, best, n_batches, args.rounds)
    return {
        "tuned": _setting(loader_only),
        "rule_only": _setting(rule_only),
        "rule_only_img_s": _rate(spec, points, rule_only, n_batches),
        "reasons": loader_only.reasons,
        "tuned_for_training": _setting(training.settings),
        "tuned_for_training_img_s": _rate(spec, points, training.settings, n_batches),
        "training_reasons": training.settings.reasons,
        "busy_others": list(probe.busy_others),
        "tuned_img_s": tuned_rate,
        "best": {"num_workers": best.num_workers, "prefetch_factor": best.prefetch_factor},
        "best_img_s": best.samples_per_s,
        "sweep_ratio": tuned_rate / best.samples_per_s if best.samples_per_s else None,
        "same_setting": h2h is None,
        "head_to_head": None if h2h is None else {"tuned_img_s": h2h[0], "best_img_s": h2h[1]},
        "ratio": 1.0 if h2h is None else h2h[0] / h2h[1],
        "sweep": [
            {
                "num_workers": p.num_workers,
                "prefetch_factor": p.prefetch_factor,
                "img_s": p.samples_per_s,
            }
            for p in points
        ],
    }


def head_to_head(
    spec: LoaderSpec, tuned: LoaderSettings, best: SweepPoint, n_batches: int, rounds: int
) -> tuple[float, float] | None:
    """Median img/s of the tuned setting and of the sweep's best, re-timed in turn `rounds` times
    (alternating which goes first, so a drift of the machine falls on both); None when the two
    are the same setting (the ratio is then 1 by identity: timing one setting twice measures
    only the noise, 0.89 in one run here).

    The sweep's best is the largest of 15 noisy timings, so it is flattered by the noise it was
    picked for (on this VM the same setting measured 36,519 and 61,998 img/s within minutes);
    timing both again, alternately, compares the settings rather than their luckiest runs.
    """
    chosen = (tuned.num_workers, tuned.prefetch_factor)
    if _matches(best, chosen) and tuned.decode_threads == 1:
        return None

    def tuned_rate() -> float:
        return measure_settings(
            spec, *chosen, n_batches, decode_threads=tuned.decode_threads
        ).samples_per_s

    def best_rate() -> float:
        return measure_settings(
            spec, best.num_workers, best.prefetch_factor, n_batches
        ).samples_per_s

    tuned_rates, best_rates = [], []
    for i in range(rounds):
        if i % 2:
            best_rates.append(best_rate())
            tuned_rates.append(tuned_rate())
        else:
            tuned_rates.append(tuned_rate())
            best_rates.append(best_rate())
    return statistics.median(tuned_rates), statistics.median(best_rates)


def _setting(settings: LoaderSettings) -> dict[str, int]:
    return {
        "num_workers": settings.num_workers,
        "prefetch_factor": settings.prefetch_factor,
        "decode_threads": settings.decode_threads,
    }


def _rate(
    spec: LoaderSpec, points: list[SweepPoint], settings: LoaderSettings, n_batches: int
) -> float:
    """Throughput of a setting: its sweep point (one decode thread), else measured now."""
    chosen = (settings.num_workers, settings.prefetch_factor)
    point = next((p for p in points if _matches(p, chosen)), None)
    if point is not None and settings.decode_threads == 1:
        return point.samples_per_s
    return measure_settings(
        spec, *chosen, n_batches, decode_threads=settings.decode_threads
    ).samples_per_s


def _matches(point: SweepPoint, chosen: tuple[int, int]) -> bool:
    return point.num_workers == chosen[0] and (chosen[0] == 0 or point.prefetch_factor == chosen[1])


def bench_dataset(ds: Dataset, args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    root = make_shards(ds, args.quick, tmp)
    if root is None:
        return None
    batch = ds.quick_batch_size if args.quick else ds.batch_size
    spec = tuning_spec(root, "train", batch, image_size=ds.image_size)
    core = min(os.sched_getaffinity(0))
    scenarios = {"idle": idle(), f"core {core} busy": busy_core(core)}
    n_batches = args.batches or ds.batches
    out: dict[str, Any] = {"batch_size": batch, "batches_timed": n_batches, "scenarios": {}}
    for name, context in scenarios.items():
        with context:
            out["scenarios"][name] = run_scenario(spec, args, n_batches)
    chosen = [s["tuned"] for s in out["scenarios"].values()]
    out["choice_changed_under_load"] = chosen[0] != chosen[1]
    training = [s["tuned_for_training"] for s in out["scenarios"].values()]
    out["training_choice_changed_under_load"] = training[0] != training[1]
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def print_table(results: dict[str, Any]) -> None:
    head = (
        f"{'dataset':<10} {'scenario':<12} {'others':>6} {'tuned (w,p,t)':>13} {'img/s':>9} "
        f"{'best (w,p)':>10} {'img/s':>9} {'sweep':>6} {'h2h':>6}  {'training (w,p,t)':>16} "
        f"{'img/s':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, res in results.items():
        for scenario, s in res["scenarios"].items():
            print(
                f"{name:<10} {scenario:<12} {sum(s['busy_others']):>6.2f} "
                f"{_wpt(s['tuned']):>13} {s['tuned_img_s']:>9,.0f} "
                f"{_wpt(s['best']):>10} {s['best_img_s']:>9,.0f} {s['sweep_ratio']:>6.2f} "
                f"{s['ratio']:>6.2f}{'=' if s['same_setting'] else ' '} "
                f"{_wpt(s['tuned_for_training']):>16} {s['tuned_for_training_img_s']:>9,.0f}"
            )
        print(
            f"{name:<10} choice changed under load: loader alone "
            f"{res['choice_changed_under_load']}, training {res['training_choice_changed_under_load']}"
        )
    print("others: cores busy with other processes during tune's probe window")
    print("tuned: sized for the loader alone (as timed here); training: with a core kept for the")
    print("training loop (what ShardDataModule gets). (w,p,t): workers, prefetch, decode threads.")
    print("sweep: tuned / best as first timed; h2h: the two re-timed in turn (--rounds, medians);")
    print("=: tuned is the sweep's best setting, so the ratio is 1 (not re-timed).")
    print("target: h2h >= 0.9")


def _wpt(setting: dict[str, int]) -> str:
    parts = [setting["num_workers"], setting["prefetch_factor"]]
    if "decode_threads" in setting:
        parts.append(setting["decode_threads"])
    return "(" + ",".join(str(p) for p in parts) + ")"


def main(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_tune_") as tmp:
        for name in args.datasets:
            res = bench_dataset(DATASETS[name], args, Path(tmp))
            if res is not None:
                results[name] = res
    if results:
        print_table(results)
    report = {
        "benchmark": "bench_tune",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment({"affinity": sorted(os.sched_getaffinity(0))}),
        "seconds": time.perf_counter() - start,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main(parse_args())
