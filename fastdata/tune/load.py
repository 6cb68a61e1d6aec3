"""The load of other processes on this machine's cores, and the intra-op threads chosen from it.

`LoadMeter` reads, over a window, every usable CPU's busy time less this process tree's own
(its loader workers included): the cores other processes take (`CoreLoad`). `choose_threads`
turns a start-up reading into torch's intra-op threads (`threads_for`, with hysteresis);
`fastdata.tune.follow.recheck` re-reads the load at every epoch end.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from fastdata.read.steady import process_tree_cpu_seconds

__all__ = [
    "HYSTERESIS_CORES",
    "CoreLoad",
    "LoadMeter",
    "LoadReaders",
    "ThreadChoice",
    "choose_threads",
    "last_thread_choice",
    "threads_for",
]

log = logging.getLogger("fastdata")

#: How far (in cores per rank) a reading must pass the midpoint between two settings to move them.
HYSTERESIS_CORES = 0.25


# ---------------------------------------------------------------------------------------------
# Measuring the load of other processes over a window
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoreLoad:
    """The cores' load over a window.

    Args:
        usable_cores: cores this process may use (affinity, capped by the cgroup quota).
        others_cores: cores' worth of busy time of every other process over the window.
        own_cores: cores' worth of busy time of this process and its children (loader workers).
        window_s: the window's length.
    """

    usable_cores: int
    others_cores: float
    own_cores: float
    window_s: float

    @property
    def idle_cores(self) -> float:
        """Cores other processes left idle (what this process may use)."""
        return max(0.0, self.usable_cores - self.others_cores)


def _busy_cpu_seconds() -> float:
    """Busy seconds of the affinity CPUs so far (every process), as psutil's cpu_percent counts:
    all time less idle and iowait; guest time is already inside user time."""
    times = psutil.cpu_times(percpu=True)
    cpus = sorted(os.sched_getaffinity(0))
    ids = cpus if cpus and max(cpus) < len(times) else range(len(times))
    busy = 0.0
    for cpu in ids:
        t = times[cpu]
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        busy += total - t.idle - getattr(t, "iowait", 0.0)
    return busy


def _usable_cores() -> int:
    from fastdata.tune.probe import read_cgroup_cpu_quota

    affinity = len(os.sched_getaffinity(0))
    quota = read_cgroup_cpu_quota()
    return affinity if quota is None else min(affinity, max(1, math.ceil(quota)))


@dataclass(frozen=True)
class LoadReaders:
    """The readings `LoadMeter` takes, one function each (tests replace them).

    Args:
        busy_seconds: busy CPU seconds of the usable CPUs so far, all processes.
        own_seconds: CPU seconds of this process and its children so far.
        usable_cores: cores this process may use.
        clock: seconds, monotonic.
    """

    busy_seconds: Callable[[], float] = _busy_cpu_seconds
    own_seconds: Callable[[], float] = process_tree_cpu_seconds
    usable_cores: Callable[[], int] = _usable_cores
    clock: Callable[[], float] = time.monotonic


class LoadMeter:
    """Measures the load of other processes between `start()` and `read()` (e.g. over an epoch).

    Args:
        readers: the machine readings (default: psutil and the cgroup files).
    """

    def __init__(self, readers: LoadReaders | None = None) -> None:
        self.readers = readers or LoadReaders()
        self._start: tuple[float, float, float] | None = None

    def start(self) -> None:
        """Open a window now."""
        r = self.readers
        self._start = (r.clock(), r.busy_seconds(), r.own_seconds())

    def read(self) -> CoreLoad | None:
        """The load since `start()` (None before a start or over an empty window)."""
        if self._start is None:
            return None
        r = self.readers
        t0, busy0, own0 = self._start
        elapsed = r.clock() - t0
        if elapsed <= 0:
            return None
        busy = max(0.0, r.busy_seconds() - busy0) / elapsed
        own = max(0.0, r.own_seconds() - own0) / elapsed
        return CoreLoad(r.usable_cores(), max(0.0, busy - own), own, elapsed)


# ---------------------------------------------------------------------------------------------
# Intra-op threads
# ---------------------------------------------------------------------------------------------


def threads_for(idle_cores: float, ranks: int, usable_cores: int, current: int | None) -> int:
    """Intra-op threads per rank for `idle_cores` left by other processes.

    The idle cores per rank, rounded (at least 1, at most the rank's share of usable cores);
    with a `current` count, it only moves when the share is more than `HYSTERESIS_CORES` past
    the midpoint between the two counts.

    Why: every parallel op waits for its slowest thread. On 2 cores with one busy elsewhere,
    2 threads ran the CIFAR ResNet step at 557 img/s and 1 thread at 1013 img/s; on idle cores
    2 threads are the faster choice.
    """
    ranks = max(1, ranks)
    share = idle_cores / ranks
    target = int(min(max(1, round(share)), max(1, usable_cores // ranks)))
    if current is None or target == current:
        return target
    if target > current and share < current + 0.5 + HYSTERESIS_CORES:
        return current
    if target < current and share > current - 0.5 - HYSTERESIS_CORES:
        return current
    return target


@dataclass(frozen=True)
class ThreadChoice:
    """A start-up choice of `choose_threads("auto")`: threads, and the load it was read from."""

    threads: int
    processes: int
    load: CoreLoad


_LAST_CHOICE: list[ThreadChoice] = []  # this process's last "auto" choice (at most one)


def last_thread_choice() -> ThreadChoice | None:
    """This process's last `choose_threads("auto", ...)` choice, or None (threads were given).

    `LoaderMonitor(threads=None)` follows the load only after such a choice, so a thread count
    the user fixed is left alone.
    """
    return _LAST_CHOICE[-1] if _LAST_CHOICE else None


def choose_threads(
    requested: int | str, processes: int, meter: LoadMeter | None = None, window_s: float = 1.0
) -> int:
    """Intra-op threads per training process on CPU: `requested`, or with "auto" the cores other
    processes leave idle over `window_s` seconds (`threads_for`), shared by this node's
    `processes`. An "auto" choice is recorded for `LoaderMonitor`, which re-checks it at every
    epoch end.

    Args:
        requested: a thread count, or "auto".
        processes: training processes on this node.
        meter: measures the load (default: a `LoadMeter` on this machine).
        window_s: seconds the start-up reading lasts.
    """
    if requested != "auto":
        _LAST_CHOICE.clear()
        return max(1, int(requested))
    meter = meter or LoadMeter()
    meter.start()
    time.sleep(window_s)
    load = meter.read()
    assert load is not None  # started just above, over a positive window
    threads = threads_for(load.idle_cores, processes, load.usable_cores, None)
    _LAST_CHOICE[:] = [ThreadChoice(threads, processes, load)]
    log.info(
        "intra-op threads: %d (%.1f of %d cores idle over %.1f s at start-up; re-checked at each "
        "epoch end when a LoaderMonitor runs)",
        threads,
        load.idle_cores,
        load.usable_cores,
        load.window_s,
    )
    return threads
