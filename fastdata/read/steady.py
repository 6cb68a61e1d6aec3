"""A loader's steady rate: images/s once its start-up and its prefetched backlog are behind it.

A loader with workers decodes ahead: while the first batch is awaited, ``workers x prefetch``
batches are made, and the next ones then arrive at once. Timing from the first batch counts that
backlog as throughput (the GPU check of 2026-12-04 reported 200,595 "steady" images/s for a cpu
backend that decodes ~4,300 a second: six batches an epoch, all of them backlog). `steady_rate`
consumes the backlog and `warmup` batches more before it starts its clock at the arrival of the
last of them, and then times `measure` batches: with the backlog consumed, each of those arrives
as fast as the loader makes it (or the caller uses it), never out of a queue filled earlier.

It also reports the first batch's wait (start-up: workers, pipeline build) and, when asked, the
CPU seconds of this process and its children (the workers) over the timed window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["SteadyRate", "batch_images", "process_tree_cpu_seconds", "steady_rate"]


@dataclass(frozen=True)
class SteadyRate:
    """What `steady_rate` measured.

    Attributes:
        images_per_s: images of the timed batches over their time; None when the loader ran out
            before `measure` batches were timed (then `reason` says how many there were).
        images: images in the timed window.
        batches: batches in the timed window.
        seconds: the timed window's length.
        skipped: batches consumed before the clock started (the backlog and the warm-up).
        first_batch_s: the wait for the first batch (start-up), from the call.
        cpu_s_per_1k: CPU seconds (this process and its children) per 1,000 timed images, when
            `steady_rate` was given a CPU clock.
        reason: why `images_per_s` is None.
    """

    images_per_s: float | None
    images: int
    batches: int
    seconds: float
    skipped: int
    first_batch_s: float | None
    cpu_s_per_1k: float | None = None
    reason: str = ""


def batch_images(batch: Any) -> int:
    """Images in a batch: the first dimension of its first tensor (of a tuple, list or dict)."""
    first = batch
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(first.shape[0])


def process_tree_cpu_seconds() -> float:
    """CPU seconds of this process, its live children (recursive) and its reaped children."""
    import psutil  # a dependency of fastdata

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # exited between listing and reading: counted once reaped
            continue
        total += c.user + c.system
    return total


def _batches_to_skip(backlog: int, warmup: int, measure: int) -> int:
    """Batches before the timed window (ValueError for a negative count or `measure` < 1)."""
    if backlog < 0 or warmup < 0 or measure < 1:
        raise ValueError(
            f"steady_rate needs backlog >= 0, warmup >= 0, measure >= 1; got {backlog}, "
            f"{warmup}, {measure}"
        )
    return backlog + warmup


def steady_rate(
    batches: Iterable[Any],
    *,
    backlog: int,
    warmup: int,
    measure: int,
    ready: Callable[[Any], int] = batch_images,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] | None = None,
) -> SteadyRate:
    """Steady images/s of `batches`: ``backlog + warmup`` batches skipped, `measure` timed.

    Args:
        batches: the loader (iterated once; stops after the timed window).
        backlog: batches the loader may hold ready before they are asked for: workers x
            prefetch for a DataLoader, the prefetch depth of a pipeline, 0 for none.
        warmup: batches more to skip after the backlog (caches, allocator, kernels' first runs).
        measure: batches to time (>= 1).
        ready: makes a batch ready and returns its image count: e.g. moves it to the GPU and
            synchronizes, so that the clock sees finished work (default: `batch_images`).
        clock: seconds (injectable for tests).
        cpu_clock: CPU seconds of the work measured (`process_tree_cpu_seconds`), or None.

    Raises:
        ValueError: a negative `backlog` or `warmup`, or `measure` < 1.
    """
    skip = _batches_to_skip(backlog, warmup, measure)
    cpu = cpu_clock if cpu_clock is not None else (lambda: 0.0)
    start = clock()
    t0, cpu0 = (start, cpu()) if skip == 0 else (None, 0.0)
    first_s = end = None
    images = timed = seen = 0
    for batch in batches:
        n = ready(batch)
        now = clock()
        seen += 1
        if first_s is None:
            first_s = now - start
        if seen <= skip:
            if seen == skip:  # the window opens when the last skipped batch is ready
                t0, cpu0 = now, cpu()
            continue
        images, timed, end = images + n, timed + 1, now
        if timed == measure:
            break
    if timed < measure or t0 is None or end is None:
        return SteadyRate(
            None, images, timed, 0.0, min(seen, skip), first_s,
            reason=f"the loader gave {seen} batches: {skip} to skip ({backlog} backlog + "
            f"{warmup} warm-up), then {measure} to time",
        )  # fmt: skip
    seconds = end - t0
    cpu_per_1k = None if cpu_clock is None else 1e3 * (cpu() - cpu0) / max(images, 1)
    rate = images / seconds if seconds > 0 else None
    reason = "" if rate is not None else "the timed window took no time on this clock"
    return SteadyRate(rate, images, timed, seconds, skip, first_s, cpu_per_1k, reason)
