"""Measured loader sizing: probe the machine, time a sample, choose workers and prefetch.

    from fastdata.tune import tune
    settings = tune("shards/cifar100", batch_size=256)     # LoaderSettings with its reasons
    print(settings.describe())

`ShardDataModule(num_workers="auto")` calls `auto_loader_settings(spec)`, a cheaper version
(short window, small batches, cached per process). `LoaderMonitor` (fastdata.tune.monitor)
watches the data wait during training. The rule itself is `fastdata.tune.sizing.size_loader`.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import warnings
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdata.manifest import Manifest, load_manifest
from fastdata.read.base import LoaderSpec, WorkerSettings
from fastdata.tune.probe import (
    Probe,
    SampleCost,
    batch_nbytes,
    measure_sample_cost,
    probe_system,
)
from fastdata.tune.sizing import MAIN_PROCESS_CORES, LoaderSettings, size_loader

__all__ = [
    "LoaderSettings",
    "SweepPoint",
    "Throughput",
    "TuneResult",
    "auto_loader_settings",
    "clear_auto_cache",
    "measure_spec_cost",
    "measure_settings",
    "measure_throughput",
    "node_ranks",
    "settings_for",
    "sweep",
    "tune",
    "tune_spec",
    "tuning_spec",
]

# Defaults of the photo path, as in ShardDataModule: variable-size photos are cropped to 224.
DEFAULT_PHOTO_SIZE = 224
SMALL_IMAGE_SIDE = 64  # raw images at most this size are "cifar"-like

# auto_loader_settings must stay well under ~2 s: a short window, small batches, a time budget.
AUTO_WINDOW_S = 0.2
AUTO_MEASURE_BATCH = 32
AUTO_BATCHES = 4
AUTO_TIME_BUDGET_S = 0.4

# Batches faster than this are timed mostly by scheduler jitter: their spread says nothing about
# the data, so it does not raise the prefetch depth.
MIN_BATCH_S_FOR_CV = 0.01

_AUTO_CACHE: dict[tuple[str, str, str, int], LoaderSettings] = {}


def tuning_spec(
    manifest_or_root: Manifest | str | os.PathLike[str],
    split: str = "train",
    batch_size: int = 256,
    preset: str = "auto",
    image_size: int | None = None,
) -> LoaderSpec:
    """The LoaderSpec (rank 0 of 1, epoch 0, no workers) that tuning measures.

    preset "auto" and image_size None resolve as in ShardDataModule: raw images keep their size
    ("cifar" preset when at most 64 pixels a side), photos are cropped to 224 ("photo").
    """
    manifest = (
        manifest_or_root
        if isinstance(manifest_or_root, Manifest)
        else load_manifest(manifest_or_root)
    )
    info = manifest.split(split)
    fixed = info.raw_shape is not None
    if image_size is None and not fixed:
        image_size = DEFAULT_PHOTO_SIZE
    if preset == "auto":
        small = info.raw_shape is not None and max(info.raw_shape[:2]) <= SMALL_IMAGE_SIDE
        preset = "cifar" if small else "photo"
    return LoaderSpec(
        manifest=manifest,
        split=split,
        train=split == "train",
        batch_size=batch_size,
        image_size=image_size,  # the CPU backend and ShardDataModule use a side length
        preset=preset,
        drop_last=False,
    )


def measure_spec_cost(
    spec: LoaderSpec, n_batches: int = 8, warmup: int = 1, time_budget_s: float | None = None
) -> SampleCost:
    """Cost of a sample of `spec` with the CPU backend in this process (num_workers=0).

    Pinning is left out: with workers it happens in the main process's pin thread, not in the
    workers whose number this cost decides.
    """
    from fastdata.read.cpu import CpuLoader  # the read side imports decoders; load on use

    measured = dataclasses.replace(
        spec,
        epoch=0,
        consumed=0,
        steps_before=0,
        rank=0,
        world_size=1,
        workers=WorkerSettings(num_workers=0, pin_memory=False, persistent_workers=False),
    )
    return measure_sample_cost(
        lambda: CpuLoader(measured),
        n_batches=n_batches,
        warmup=warmup,
        time_budget_s=time_budget_s,
    )


def node_ranks() -> int:
    """Training processes on this machine: $LOCAL_WORLD_SIZE (torchrun) or 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class TuneResult:
    """What `tune_spec` measured and chose.

    Args:
        settings: the chosen settings with their reasons.
        probe: the machine's figures (None for backends without workers).
        cost: the measured sample cost (None for backends without workers).
    """

    settings: LoaderSettings
    probe: Probe | None = None
    cost: SampleCost | None = None


def tune_spec(
    spec: LoaderSpec,
    backend: str = "cpu",
    consumer_rate: float | None = None,
    window_s: float = 0.5,
    n_batches: int = 8,
) -> TuneResult:
    """Probe the machine, time samples of `spec` with the CPU backend, size the loader."""
    if not _uses_workers(backend):
        return TuneResult(_no_workers(backend))
    probe = probe_system(window_s)
    cost = measure_spec_cost(spec, n_batches=n_batches)
    settings = settings_for(probe, cost, consumer_rate, spec.batch_size, backend, node_ranks())
    return TuneResult(settings, probe, cost)


def tune(
    manifest_or_root: Manifest | str | os.PathLike[str],
    split: str = "train",
    backend: str = "cpu",
    batch_size: int = 256,
    preset: str = "auto",
    image_size: int | None = None,
    consumer_rate: float | None = None,
    window_s: float = 0.5,
    n_batches: int = 8,
) -> LoaderSettings:
    """Probe the machine, time samples of the split, and size the loader (see `size_loader`).

    Args:
        manifest_or_root: a Manifest or the shard folder.
        split: split to measure.
        backend: the backend the settings are for ("cpu", "dali": CPU threads, "memory": none).
        batch_size: samples per batch.
        preset: augmentation preset ("auto" resolves as in ShardDataModule).
        image_size: output side of variable-size photos (default 224).
        consumer_rate: samples/s the training step consumes; None = unknown (use free cores).
        window_s: seconds over which the core load is measured.
        n_batches: batches timed for the sample cost (after one warm-up batch).
    """
    spec = tuning_spec(manifest_or_root, split, batch_size, preset, image_size)
    return tune_spec(spec, backend, consumer_rate, window_s, n_batches).settings


def auto_loader_settings(
    spec: LoaderSpec, backend: str = "cpu", ranks_per_node: int | None = None
) -> LoaderSettings:
    """Settings for `num_workers="auto"` / `prefetch_factor="auto"`; cheap and cached.

    Measures over a 0.2 s window and at most ~0.4 s of batches of up to 32 samples (a sample
    costs the same in a small batch), then caches the result for this process per
    (manifest root, split, backend, batch size). pin_memory follows `spec.device`.

    Args:
        spec: the loader's spec (its num_workers / prefetch_factor are ignored).
        backend: the backend the settings are for.
        ranks_per_node: training processes sharing this machine (default: $LOCAL_WORLD_SIZE or 1;
            pass `trainer.num_devices` under Lightning's own launcher, which does not set it).
    """
    key = (spec.manifest.root, spec.split, backend, spec.batch_size)
    if key not in _AUTO_CACHE:
        if not _uses_workers(backend):
            _AUTO_CACHE[key] = _no_workers(backend)
        else:
            probe = dataclasses.replace(
                probe_system(AUTO_WINDOW_S), cuda_available=str(spec.device).startswith("cuda")
            )
            small = dataclasses.replace(spec, batch_size=min(spec.batch_size, AUTO_MEASURE_BATCH))
            cost = measure_spec_cost(
                small, n_batches=AUTO_BATCHES, time_budget_s=AUTO_TIME_BUDGET_S
            )
            ranks = ranks_per_node if ranks_per_node is not None else node_ranks()
            _AUTO_CACHE[key] = settings_for(probe, cost, None, spec.batch_size, backend, ranks)
    cached = _AUTO_CACHE[key]
    return dataclasses.replace(cached, reasons=list(cached.reasons))  # callers may edit reasons


def clear_auto_cache() -> None:
    """Forget the settings `auto_loader_settings` cached (e.g. after the machine's load changed)."""
    _AUTO_CACHE.clear()


def settings_for(
    probe: Probe,
    cost: SampleCost,
    consumer_rate: float | None,
    batch_size: int,
    backend: str = "cpu",
    ranks_per_node: int = 1,
    main_cores: float = MAIN_PROCESS_CORES,
) -> LoaderSettings:
    """`size_loader` on measured figures, with the sample cost as the first reason.

    A batch-time spread is only passed on when batches take at least `MIN_BATCH_S_FOR_CV`."""
    settings = size_loader(
        probe,
        cost.cpu_s_per_sample,
        consumer_rate,
        batch_size,
        int(cost.bytes_per_sample * batch_size),
        batch_cost_cv=_meaningful_cv(cost),
        ranks_per_node=ranks_per_node,
        main_cores=main_cores,
    )
    settings.reasons.insert(
        0,
        f"sample cost {cost.cpu_s_per_sample * 1e6:.1f} us CPU ({cost.wall_s_per_sample * 1e6:.1f} us "
        f"wall) over {cost.samples} samples, {cost.bytes_per_sample / 1024:.1f} KiB per sample",
    )
    if backend == "dali":
        settings.reasons.append(
            "dali: num_workers is the DALI CPU thread count, sized from the CPU decode cost"
        )
    return settings


def _meaningful_cv(cost: SampleCost) -> float:
    if cost.batches < 3 or cost.wall_s / cost.batches < MIN_BATCH_S_FOR_CV:
        return 0.0
    return cost.batch_cv


def _uses_workers(backend: str) -> bool:
    """Whether the registered backend's loading runs in processes (or threads) worth sizing."""
    from fastdata.read import get_backend

    entry = get_backend(backend)
    return entry.uses_workers or entry.name == "dali"  # DALI: the CPU thread count


def _no_workers(backend: str) -> LoaderSettings:
    from fastdata.read import get_backend

    why = f"{backend} backend: its loading runs in no worker processes"
    if get_backend(backend).resident:
        why = f"{backend} backend: the decoded split lives on the device, no loader workers needed"
    return LoaderSettings(0, 2, False, False, [why])


@dataclass(frozen=True)
class Throughput:
    """Steady-state speed of a loader.

    Args:
        samples: samples timed.
        batches: batches timed.
        seconds: wall seconds they took.
        startup_s: seconds from `iter()` to the end of the warm-up batches (worker start-up).
        notes: what to know about the figure (e.g. the loader ran out early).
    """

    samples: int
    batches: int
    seconds: float
    startup_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def measure_throughput(loader: Iterable[object], n_batches: int, warmup: int = 1) -> Throughput:
    """Samples per second over `n_batches` batches, after `warmup` batches.

    Choose `warmup` at least num_workers * prefetch_factor: those batches are made while the
    workers start and arrive in a burst that would flatter the steady state.
    """
    start = time.perf_counter()
    iterator = iter(loader)  # a DataLoader starts its workers here
    for _ in range(warmup):
        if next(iterator, None) is None:
            raise ValueError(f"the loader has fewer than {warmup} warm-up batches; lower warmup")
    timed_start = time.perf_counter()
    samples = batches = 0
    for batch in iterator:
        samples += batch_nbytes(batch)[1]
        batches += 1
        if batches >= n_batches:
            break
    end = time.perf_counter()
    notes = [] if batches >= n_batches else [f"the loader ran out after {batches} timed batches"]
    return Throughput(samples, batches, end - timed_start, timed_start - start, notes)


@dataclass(frozen=True)
class SweepPoint:
    """Throughput of the CPU backend at one (num_workers, prefetch_factor)."""

    num_workers: int
    prefetch_factor: int
    throughput: Throughput

    @property
    def samples_per_s(self) -> float:
        return self.throughput.samples_per_s


def sweep(
    spec: LoaderSpec,
    workers: Sequence[int] = (0, 1, 2, 3, 4),
    prefetch: Sequence[int] = (1, 2, 4),
    n_batches: int = 20,
) -> list[SweepPoint]:
    """Measure the CPU backend's steady-state throughput at every (num_workers, prefetch_factor).

    With 0 workers prefetch_factor means nothing, so it is measured once (reported with the
    first prefetch value). See `measure_settings` for how each point is timed.
    """
    points = []
    for w in workers:
        for p in prefetch if w > 0 else prefetch[:1]:
            points.append(SweepPoint(w, p, measure_settings(spec, w, p, n_batches)))
    return points


def measure_settings(
    spec: LoaderSpec, num_workers: int, prefetch_factor: int, n_batches: int
) -> Throughput:
    """Steady-state throughput of the CPU backend with these settings (workers shut down after).

    Skips num_workers * prefetch_factor + 1 warm-up batches (those made while the workers
    start arrive in a burst), then times `n_batches`, running on into further epochs with
    persistent workers when the split is shorter, as training would.
    """
    from fastdata.read.cpu import CpuLoader

    with warnings.catch_warnings():
        # A sweep goes past the core count on purpose; torch warns about that (twice).
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        loader = CpuLoader(
            dataclasses.replace(
                spec,
                workers=WorkerSettings(
                    num_workers=num_workers,
                    prefetch_factor=prefetch_factor,
                    pin_memory=False,
                    persistent_workers=num_workers > 0,
                ),
            )
        )
        batches = _epochs(loader)
        try:
            return measure_throughput(batches, n_batches, warmup=num_workers * prefetch_factor + 1)
        finally:
            batches.close()
            del batches, loader
            gc.collect()  # the DataLoader's iterator shuts its workers down when collected


def _epochs(loader: Any) -> Generator[object, None, None]:
    """The batches of epoch 0, 1, 2, ... of a loader with `set_epoch`, until one is empty."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return
        epoch += 1
