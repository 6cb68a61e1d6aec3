"""Timing loaders: the cost of a sample (`SampleCost`), a loader's steady-state throughput, a settings sweep.

`measure_throughput` is the one throughput timer of the project (the benchmarks use it too);
`measure_settings` times the CPU backend at given (workers, prefetch, decode threads).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdata.read.base import LoaderSpec, WorkerSettings

__all__ = [
    "SampleCost",
    "SweepPoint",
    "Throughput",
    "batch_nbytes",
    "measure_sample_cost",
    "measure_settings",
    "measure_spec_cost",
    "measure_throughput",
    "sweep",
]


# ---------------------------------------------------------------------------------------------
# Cost of a sample
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleCost:
    """Cost of producing batches in the main process (num_workers=0).

    Args:
        batches: batches timed (after the warm-up).
        samples: samples in them.
        cpu_s: process CPU seconds (`time.process_time`) spent producing them.
        wall_s: wall seconds spent producing them.
        batch_wall_s: wall seconds of each timed batch.
        bytes_per_sample: bytes of a batch (images + labels) divided by its samples.
        warmup_s: wall seconds of the warm-up batches (first open of shards, caches).
        includes_warmup: True when the split was too short to leave any batch after the warm-up,
            so the warm-up batches were timed (the cost is then an overestimate).
    """

    batches: int
    samples: int
    cpu_s: float
    wall_s: float
    batch_wall_s: tuple[float, ...]
    bytes_per_sample: float
    warmup_s: float = 0.0
    includes_warmup: bool = False

    @property
    def cpu_s_per_sample(self) -> float:
        return self.cpu_s / self.samples

    @property
    def wall_s_per_sample(self) -> float:
        return self.wall_s / self.samples

    @property
    def batch_cv(self) -> float:
        """Spread of the per-batch wall time: a robust coefficient of variation,
        IQR / (1.349 * median) (equal to stdev / mean for normally distributed times), so that one
        batch stalled by another process does not count as "batches vary". 0 below 3 batches."""
        if len(self.batch_wall_s) < 3:
            return 0.0
        q1, median, q3 = statistics.quantiles(self.batch_wall_s, n=4, method="inclusive")
        return (q3 - q1) / (1.349 * median) if median > 0 else 0.0

    def describe(self) -> str:
        note = " (warm-up included: the split is short)" if self.includes_warmup else ""
        return (
            f"sample cost       {self.cpu_s_per_sample * 1e6:.1f} us CPU, "
            f"{self.wall_s_per_sample * 1e6:.1f} us wall per sample over {self.samples} samples "
            f"in {self.batches} batches{note}; batch-time CV {self.batch_cv:.2f}; "
            f"{self.bytes_per_sample / 1024:.1f} KiB per sample"
        )


def batch_nbytes(batch: object) -> tuple[int, int]:
    """(bytes, samples) of a batch: the tensors of a tuple/list or of a dict batch's values
    (and of its lists of per-sample tensors), samples from the first one."""
    if isinstance(batch, dict):  # a dict dataset's batch (`fastdata.read.decoders.dict_batch`)
        items = list(batch.values())
        lists = [t for v in items if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
        first = [t for t in items if isinstance(t, torch.Tensor)]
        if first:
            nbytes = sum(t.element_size() * t.numel() for t in first + lists)
            return nbytes, int(first[0].shape[0]) if first[0].dim() else 1
    tensors = (
        [t for t in batch if isinstance(t, torch.Tensor)] if isinstance(batch, tuple | list) else []
    )
    if isinstance(batch, torch.Tensor):
        tensors = [batch]
    if not tensors:
        raise TypeError(f"expected a batch of tensors (images, labels), got {type(batch).__name__}")
    nbytes = sum(t.element_size() * t.numel() for t in tensors)
    return nbytes, int(tensors[0].shape[0]) if tensors[0].dim() else 1


def measure_sample_cost(
    loader_factory: Callable[[], Iterable[object]],
    n_batches: int = 8,
    warmup: int = 1,
    time_budget_s: float | None = None,
) -> SampleCost:
    """Time batches produced in this process (build the loader with num_workers=0).

    The first `warmup` batches pay one-time costs (opening shards, reading indexes) and are
    left out, unless the split has no batch after them. Timing stops after `n_batches` timed
    batches or once `time_budget_s` seconds of timed batches have passed.

    Args:
        loader_factory: builds the loader (an iterable of (images, labels)) to time.
        n_batches: most batches to time.
        warmup: batches to skip first.
        time_budget_s: stop early after this many seconds of timed batches.
    """
    if n_batches < 1 or warmup < 0:
        raise ValueError(f"need n_batches >= 1 and warmup >= 0, got {n_batches!r}, {warmup!r}")
    walls: list[float] = []
    cpus: list[float] = []
    sizes: list[tuple[int, int]] = []
    iterator = iter(loader_factory())
    while len(walls) < warmup + n_batches:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
        sizes.append(batch_nbytes(batch))
        if time_budget_s is not None and sum(walls[warmup:]) >= time_budget_s:
            break
    if not walls:
        raise ValueError("the loader yielded no batch: is the split empty or the batch too large?")
    skip = warmup if len(walls) > warmup else 0
    timed = slice(skip, None)
    nbytes, samples = (sum(col) for col in zip(*sizes[timed], strict=True))
    return SampleCost(
        batches=len(walls[timed]),
        samples=samples,
        cpu_s=sum(cpus[timed]),
        wall_s=sum(walls[timed]),
        batch_wall_s=tuple(walls[timed]),
        bytes_per_sample=nbytes / samples,
        warmup_s=sum(walls[:skip]),
        includes_warmup=skip == 0 and warmup > 0,
    )


def measure_spec_cost(
    spec: LoaderSpec, n_batches: int = 8, warmup: int = 1, time_budget_s: float | None = None
) -> SampleCost:
    """Cost of a sample of `spec` with the CPU backend in this process (num_workers=0).

    Pinning is left out: with workers it happens in the main process's pin thread, not in the
    workers whose number this cost decides.
    """
    from fastdata.read.backends.cpu import CpuLoader  # the read side imports decoders; load on use

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


def measure_throughput(
    loader: Iterable[Any],
    n_batches: int | None,
    warmup: int = 1,
    count: Callable[[Any], int] | None = None,
) -> Throughput:
    """Samples per second over `n_batches` batches (None: until the loader ends), after `warmup`.

    Choose `warmup` at least num_workers * prefetch_factor: those batches are made while the
    workers start and arrive in a burst that would flatter the steady state.

    Args:
        loader: an iterable of batches (a DataLoader starts its workers at `iter()`).
        n_batches: batches to time after the warm-up; None times every remaining batch.
        warmup: batches taken first, untimed (each one also goes through `count`).
        count: consumes a batch (e.g. copies it to the device and augments it) and returns its
            samples; default: the samples of a batch of tensors, nothing else done.
    """
    count = count or (lambda batch: batch_nbytes(batch)[1])
    start = time.perf_counter()
    iterator = iter(loader)
    for _ in range(warmup):
        batch = next(iterator, None)
        if batch is None:
            raise ValueError(f"the loader has fewer than {warmup} warm-up batches; lower warmup")
        count(batch)
    timed_start = time.perf_counter()
    samples = batches = 0
    for batch in iterator:
        samples += count(batch)
        batches += 1
        if n_batches is not None and batches >= n_batches:
            break
    end = time.perf_counter()
    short = n_batches is not None and batches < n_batches
    notes = [f"the loader ran out after {batches} timed batches"] if short else []
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
    spec: LoaderSpec,
    num_workers: int,
    prefetch_factor: int,
    n_batches: int,
    decode_threads: int = 1,
) -> Throughput:
    """Steady-state throughput of the CPU backend with these settings (workers shut down after).

    `decode_threads` threads decode each batch's photos in every worker (in this process with
    0 workers).

    Skips num_workers * prefetch_factor + 1 warm-up batches (those made while the workers
    start arrive in a burst), then times `n_batches`, running on into further epochs with
    persistent workers when the split is shorter, as training would.
    """
    from fastdata.read.backends.cpu import CpuLoader

    with warnings.catch_warnings():
        # A sweep goes past the core count on purpose; torch warns about that (twice).
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        loader = CpuLoader(
            dataclasses.replace(
                spec,
                workers=WorkerSettings(
                    num_workers=num_workers,
                    prefetch_factor=prefetch_factor,
                    decode_threads=decode_threads,
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
