"""Measure what the loader sizing needs: usable cores, their load, free memory.

The cost of a sample is timed in `fastdata.tune.measure`.

Every reading of the machine goes through one small function held in `ProbeReaders`, so a test
can replace any of them (`dataclasses.replace(DEFAULT_READERS, cpu_percent=...)`) and the sizing
rule (`fastdata.tune.sizing`) stays a pure function of the `Probe` these readings produce.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

__all__ = [
    "DEFAULT_READERS",
    "WORKER_RSS_FALLBACK_BYTES",
    "Probe",
    "ProbeReaders",
    "parse_cfs_quota",
    "parse_cpu_max",
    "probe_system",
    "read_cgroup_cpu_quota",
    "read_cgroup_memory_free",
]

# A worker that has not started yet is costed as a fresh interpreter with torch, numpy and PIL
# imported (measured: ~220 MiB RSS, torch 2.x on x86-64), rounded up. A forked worker shares most
# of those pages with its parent, so this overestimates: safe for a memory cap.
WORKER_RSS_FALLBACK_BYTES = 256 * 2**20

# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages), not as a word.
_UNLIMITED_BYTES = 2**60


# ---------------------------------------------------------------------------------------------
# cgroup readings (pure parsers + one reader each)
# ---------------------------------------------------------------------------------------------


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` ("quota period" or "max period"); None = no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = float(parts[1]) if len(parts) > 1 else 100_000.0
    return float(parts[0]) / period


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None when quota is -1."""
    quota = int(quota_text.strip())
    if quota < 0:
        return None
    return quota / int(period_text.strip())


def _own_cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller name -> this process's cgroup path ("" key for the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _cgroup_dirs(root: Path, subdir: str, own_path: str | None) -> list[Path]:
    """Folders to look in, most specific first: this process's own cgroup, then the mount root
    (inside a container the mount root usually *is* the container's cgroup)."""
    base = root / subdir if subdir else root
    dirs = [base / own_path.lstrip("/")] if own_path and own_path != "/" else []
    return dirs + [base]


def read_cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The cgroup CPU quota of this process in CPUs (1.5 = one and a half cores), or None.

    Looks at cgroup v2 `cpu.max`, then v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (mounted as
    `cpu` or `cpu,cpuacct`); the smallest quota found wins.
    """
    own = _own_cgroup_paths(proc_cgroup)
    quotas: list[float] = []
    for folder in _cgroup_dirs(root, "", own.get("")):
        text = _read(folder / "cpu.max")
        if text is not None and (q := parse_cpu_max(text)) is not None:
            quotas.append(q)
    for subdir in ("cpu", "cpu,cpuacct"):
        for folder in _cgroup_dirs(root, subdir, own.get("cpu")):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota is not None and period is not None:
                if (q := parse_cfs_quota(quota, period)) is not None:
                    quotas.append(q)
    return min(quotas) if quotas else None


def read_cgroup_memory_free(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Bytes left under the cgroup memory limit (limit - usage), or None when there is no limit."""
    own = _own_cgroup_paths(proc_cgroup)
    candidates = [
        (folder / "memory.max", folder / "memory.current")
        for folder in _cgroup_dirs(root, "", own.get(""))
    ] + [
        (folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes")
        for folder in _cgroup_dirs(root, "memory", own.get("memory"))
    ]
    free: list[int] = []
    for limit_file, usage_file in candidates:
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None or limit.strip() == "max":
            continue
        if int(limit) < _UNLIMITED_BYTES:
            free.append(max(0, int(limit) - int(usage)))
    return min(free) if free else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


def _own_cpu_seconds() -> float:
    """CPU seconds used so far by this process (all its threads).

    Children are not counted: under Lightning's DDP launcher the other ranks are children of
    rank 0, and their load is as real as any other process's. Idle loader workers use no CPU.
    """
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _available_memory() -> int:
    available = psutil.virtual_memory().available
    cgroup_free = read_cgroup_memory_free()
    return available if cgroup_free is None else min(available, cgroup_free)


def _worker_rss() -> int:
    """Mean unique memory (USS) of this process's live children, else the fallback figure."""
    sizes = []
    for child in psutil.Process().children(recursive=True):
        try:
            sizes.append(child.memory_full_info().uss)
        except psutil.Error:
            continue
    return int(statistics.fmean(sizes)) if sizes else WORKER_RSS_FALLBACK_BYTES


@dataclass(frozen=True)
class ProbeReaders:
    """The machine readings, one function each (replace any of them in tests).

    Args:
        affinity: CPU ids this process may run on.
        cgroup_quota: CPUs allowed by the cgroup quota, None for no quota.
        cpu_percent: given a window in seconds, busy percent of every logical CPU over it
            (blocks for the window, like `psutil.cpu_percent(interval=w, percpu=True)`).
        own_cpu_seconds: CPU seconds used so far by this process.
        available_memory: bytes that can be allocated without swapping.
        worker_rss: bytes one loader worker costs.
        cuda_available: whether batches will go to a CUDA device (pin host memory then).
    """

    affinity: Callable[[], Iterable[int]] = lambda: os.sched_getaffinity(0)
    cgroup_quota: Callable[[], float | None] = read_cgroup_cpu_quota
    cpu_percent: Callable[[float], list[float]] = lambda w: psutil.cpu_percent(
        interval=w, percpu=True
    )
    own_cpu_seconds: Callable[[], float] = _own_cpu_seconds
    available_memory: Callable[[], int] = _available_memory
    worker_rss: Callable[[], int] = _worker_rss
    cuda_available: Callable[[], bool] = torch.cuda.is_available


DEFAULT_READERS = ProbeReaders()


@dataclass(frozen=True)
class Probe:
    """One look at the machine.

    Args:
        affinity: CPU ids this process may run on.
        cgroup_quota: CPUs allowed by the cgroup quota (None: no quota).
        usable_cores: len(affinity), capped by ceil(cgroup_quota).
        busy_total: busy fraction (0..1) of each affinity CPU over the window, all processes.
        busy_others: the same less this process's own share: the load of other processes.
        own_cores: CPUs' worth of time used by this process over the window.
        window_s: length of the measuring window.
        available_bytes: free memory (the smaller of the system's and the cgroup's).
        worker_rss_bytes: estimated memory of one loader worker.
        cuda_available: whether CUDA is available.
    """

    affinity: tuple[int, ...]
    cgroup_quota: float | None
    usable_cores: int
    busy_total: tuple[float, ...]
    busy_others: tuple[float, ...]
    own_cores: float
    window_s: float
    available_bytes: int
    worker_rss_bytes: int
    cuda_available: bool

    def describe(self) -> str:
        """Multi-line human summary of the figures."""
        quota = "none" if self.cgroup_quota is None else f"{self.cgroup_quota:.2f} CPUs"
        per_core = " ".join(f"{b:.0%}" for b in self.busy_others)
        return "\n".join(
            [
                f"usable cores      {self.usable_cores} (affinity {len(self.affinity)}, "
                f"cgroup quota {quota})",
                f"busy (others)     {per_core} over {self.window_s:.2f} s "
                f"(this process: {self.own_cores:.2f} cores)",
                f"available memory  {self.available_bytes / 2**30:.2f} GiB",
                f"per-worker RSS    {self.worker_rss_bytes / 2**20:.0f} MiB (estimate)",
                f"CUDA              {'yes' if self.cuda_available else 'no'}",
            ]
        )


def probe_system(window_s: float = 0.5, readers: ProbeReaders = DEFAULT_READERS) -> Probe:
    """Read cores, their load over `window_s` seconds, and memory.

    The load of other processes is the total busy time of the affinity CPUs less this process's
    own. psutil reports per CPU but not per process per CPU, so our own
    share is taken off every CPU in proportion to its load.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    affinity = tuple(sorted(readers.affinity()))
    quota = readers.cgroup_quota()
    usable = len(affinity) if quota is None else min(len(affinity), max(1, math.ceil(quota)))
    own_before = readers.own_cpu_seconds()
    start = time.perf_counter()
    percents = readers.cpu_percent(window_s)
    # psutil blocks for the window; use the measured length so a late wake-up does not inflate it.
    elapsed = max(time.perf_counter() - start, window_s)
    own = max(0.0, (readers.own_cpu_seconds() - own_before) / elapsed)
    # psutil lists CPUs by id; with offline CPUs the ids can run past the list, then read the
    # list in order (the best that /proc/stat tells us).
    ids = affinity if affinity and max(affinity) < len(percents) else range(len(affinity))
    busy = tuple(min(1.0, max(0.0, percents[cpu] / 100.0)) for cpu in ids)
    total = sum(busy)
    others_share = max(0.0, 1.0 - own / total) if total > 0 else 0.0
    return Probe(
        affinity=affinity,
        cgroup_quota=quota,
        usable_cores=usable,
        busy_total=busy,
        busy_others=tuple(b * others_share for b in busy),
        own_cores=own,
        window_s=window_s,
        available_bytes=int(readers.available_memory()),
        worker_rss_bytes=int(readers.worker_rss()),
        cuda_available=bool(readers.cuda_available()),
    )
