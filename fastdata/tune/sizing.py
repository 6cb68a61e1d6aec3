"""Choose DataLoader settings from measured figures: a pure function, no reading of the machine.

`size_loader` turns a `Probe` (cores, their load, memory) and the measured cost of a sample into
`LoaderSettings`, and says why in `reasons`, naming the figures it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fastdata.tune.probe import Probe

__all__ = [
    "DEFAULT_PREFETCH",
    "HIGH_VARIATION_CV",
    "MAIN_KEEPS_UP_SHARE",
    "MAIN_PROCESS_CORES",
    "MIN_OVERLAP_CORES",
    "PREFETCH_MEMORY_SHARE",
    "VARIABLE_PREFETCH",
    "WORKER_MEMORY_SHARE",
    "LoaderSettings",
    "free_cores",
    "max_workers_by_memory",
    "size_loader",
    "workers_for_loop",
]

# The training process itself keeps one core busy (Python loop, kernel launches, collation).
MAIN_PROCESS_CORES = 1.0
# A worker overlaps with the training loop only with this many idle cores (the loop's and one more,
# less a margin for the noise of a load reading): below it, workers only take turns with the loop.
MIN_OVERLAP_CORES = 1.5
# Loading in the main process is good enough when it adds at most this share to a step.
MAIN_KEEPS_UP_SHARE = 0.05
# Prefetched batches (num_workers * prefetch_factor of them) may use this share of free memory.
PREFETCH_MEMORY_SHARE = 0.25
# The workers' own memory may use this share of free memory.
WORKER_MEMORY_SHARE = 0.5
# PyTorch's default: enough to hide the jitter of a steady per-batch cost.
DEFAULT_PREFETCH = 2
# When batch times vary a lot (mixed image sizes, cold files), a deeper queue absorbs slow batches.
VARIABLE_PREFETCH = 4
# Coefficient of variation of the per-batch time above which batches "vary a lot".
HIGH_VARIATION_CV = 0.5


@dataclass(frozen=True)
class LoaderSettings:
    """DataLoader settings and why they were chosen.

    Args:
        num_workers: worker processes (0: load in the main process).
        prefetch_factor: batches queued per worker (meaningless with 0 workers).
        pin_memory: copy batches into page-locked memory (faster, asynchronous H2D copies).
        persistent_workers: keep workers alive between epochs (no start-up cost per epoch).
        reasons: one line per decision, naming the figures.
        decode_threads: threads decoding a batch's photos in each worker (in the main process
            with 0 workers); 1 unless chosen by timing (`fastdata.tune.confirm`).
    """

    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    persistent_workers: bool
    reasons: list[str] = field(default_factory=list)
    decode_threads: int = 1

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `torch.utils.data.DataLoader` (it rejects a prefetch_factor and
        persistent workers when num_workers is 0)."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
        return kwargs

    def describe(self) -> str:
        """The choice on one line, then its reasons."""
        head = (
            f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
            f"decode_threads={self.decode_threads} pin_memory={self.pin_memory} persistent_workers={self.persistent_workers}"
        )
        return "\n".join([head, *(f"  - {r}" for r in self.reasons)])


def free_cores(
    probe: Probe, ranks_per_node: int = 1, main_cores: float = MAIN_PROCESS_CORES
) -> float:
    """Cores left for loader workers of one rank.

    Sum of (1 - busy fraction of other processes) over the `usable_cores` least-loaded CPUs of
    the affinity set, less `main_cores` per training process on this node, shared among the ranks.
    A cgroup quota of 1.5 CPUs counts as 2 usable cores: a worker that shares the half core
    still overlaps its work with the main process, which loading in-line never does.
    """
    idle = sorted((1.0 - b for b in probe.busy_others), reverse=True)[: probe.usable_cores]
    return max(0.0, (sum(idle) - ranks_per_node * main_cores) / ranks_per_node)


def workers_for_loop(
    idle_cores: float, batch_cost_s: float | None = None, loop_s: float | None = None
) -> tuple[int, str]:
    """Workers for one training process, from the idle cores and the loop's measured load.

    A step with w workers on C idle cores takes about max(L, D / w, (L + D) / C) seconds, with
    L the loop's own time per step (compute: the step less its data wait) and D the CPU seconds
    of making a batch (read + decode). So:

    - fewer than `MIN_OVERLAP_CORES` idle cores: 0 workers. The loop and a worker would only
      take turns on one core, and the worker adds its hand-over on top (measured on 2 cores with
      one kept busy by another process: 0 workers were the fastest of 0-4);
    - L or D not measured yet (start-up): floor(C) workers. The loop waits for data part of each
      step and its core is the workers' then, so no whole core is kept for it (measured on 2
      idle cores: 2-3 workers were the fastest; keeping a core gave 1 and 75-82% of the best);
    - measured: 0 when making a batch in-line adds at most `MAIN_KEEPS_UP_SHARE` to the step,
      else the fewest workers that reach the best step max(L, (L + D) / C):
      ceil(D / that), at least 1 and at most floor(C).

    Args:
        idle_cores: cores other processes leave idle, for this training process (its share).
        batch_cost_s: seconds of CPU to make one batch (None: not measured).
        loop_s: the loop's own seconds per step, besides waiting for data (None: not measured).

    Returns:
        (workers, the reason on one line, naming the figures).
    """
    if idle_cores < MIN_OVERLAP_CORES:
        return 0, (
            f"0 workers: {idle_cores:.2f} idle cores leave no second core for a worker to "
            f"overlap with the training loop (< {MIN_OVERLAP_CORES}); load in the main process"
        )
    cap = math.floor(idle_cores)
    if batch_cost_s is None or loop_s is None:
        return cap, (
            f"{cap} workers = floor({idle_cores:.2f} idle cores): the training loop's load is "
            "not measured yet (it waits for data part of each step, and its core is the "
            "workers' then); re-checked from the measured step at each epoch end"
        )
    figures = f"a batch costs {batch_cost_s * 1e3:.1f} ms, the loop {loop_s * 1e3:.1f} ms a step"
    if batch_cost_s <= MAIN_KEEPS_UP_SHARE * loop_s:
        return 0, f"0 workers: {figures}: in-line loading adds <= {MAIN_KEEPS_UP_SHARE:.0%}"
    best = max(loop_s, (loop_s + batch_cost_s) / idle_cores, 1e-9)
    needed = math.ceil(batch_cost_s / best - 1e-9)
    workers = max(1, min(needed, cap))
    return workers, (
        f"{workers} workers: {figures}; on {idle_cores:.2f} idle cores a step takes at best "
        f"{best * 1e3:.1f} ms, which {needed} workers keep up with (at most {cap})"
    )


def size_loader(
    probe: Probe,
    sample_cost_s: float,
    consumer_rate: float | None,
    batch_size: int,
    batch_bytes: int,
    *,
    batch_cost_cv: float = 0.0,
    ranks_per_node: int = 1,
    main_cores: float | None = None,
) -> LoaderSettings:
    """Choose num_workers, prefetch_factor, pin_memory and persistent_workers.

    The rule:

    1. free cores = sum over the usable cores of (1 - busy fraction of other processes), minus
       `main_cores` per training process (`free_cores`); with several ranks per node, each rank
       gets its share. With `main_cores` None (the default: the training loop's load is not
       measured at start-up) and an unknown consumer rate, `workers_for_loop` sizes from the
       idle cores alone.
    2. workers needed = ceil(consumer_rate * sample_cost_s): the cores of decoding the consumer
       asks for. With an unknown consumer rate, the loader is assumed to be the bottleneck and
       every free core is used. 0 workers when the main process alone keeps up, i.e. loading
       in-line would add at most `MAIN_KEEPS_UP_SHARE` to each step.
    3. num_workers = clamp(min(needed, floor(free cores)), 0, usable cores), then lowered so that
       the workers' memory (num_workers * per-worker RSS) stays within `WORKER_MEMORY_SHARE` of
       free memory.
    4. prefetch_factor = the largest of {1, 2, 4} not above the target (`DEFAULT_PREFETCH`, or
       `VARIABLE_PREFETCH` when the per-batch cost varies, CV > `HIGH_VARIATION_CV`) such that
       num_workers * prefetch_factor * batch_bytes stays within `PREFETCH_MEMORY_SHARE` of free
       memory (1 if even that does not fit).
    5. pin_memory when CUDA is available; persistent_workers when num_workers > 0.

    Args:
        probe: the machine's figures (`fastdata.tune.probe.probe_system`).
        sample_cost_s: CPU seconds to produce one sample in the main process.
        consumer_rate: samples per second the training step consumes; None when unknown.
        batch_size: samples per batch.
        batch_bytes: bytes of one batch (images + labels).
        batch_cost_cv: coefficient of variation of the per-batch time.
        ranks_per_node: training processes sharing this machine's cores.
        main_cores: cores kept for each training process (0: nothing but the loader runs, as in
            a loader benchmark); None: not measured, `workers_for_loop` decides.
    """
    _check_inputs(
        sample_cost_s, consumer_rate, batch_size, batch_bytes, ranks_per_node, main_cores or 0.0
    )
    reasons: list[str] = []
    workers = _worker_count(
        probe, sample_cost_s, consumer_rate, ranks_per_node, main_cores, reasons
    )
    workers = _cap_by_worker_memory(workers, probe, reasons)
    prefetch = _prefetch_from_memory(
        workers, probe, batch_size, batch_bytes, batch_cost_cv, reasons
    )
    reasons.append(_PIN_REASONS[probe.cuda_available])
    return LoaderSettings(workers, prefetch, probe.cuda_available, workers > 0, reasons)


_PIN_REASONS = {
    True: "pin_memory: CUDA is available, page-locked batches copy asynchronously",
    False: "pin_memory off: no CUDA device to copy to",
}


def _worker_count(
    probe: Probe,
    sample_cost_s: float,
    consumer_rate: float | None,
    ranks_per_node: int,
    main_cores: float | None,
    reasons: list[str],
) -> int:
    """`size_loader`'s steps 1-3 before the memory cap: from the idle cores alone when the
    training loop's load is not measured and the consumer rate unknown, else from the free
    cores less `main_cores` (or `MAIN_PROCESS_CORES`) per rank and the consumer rate."""
    if main_cores is None and consumer_rate is None:
        idle = free_cores(probe, ranks_per_node, 0.0)
        if probe.cgroup_quota is not None:  # a quota of 1.5 CPUs runs 1.5 cores' work, not 2
            idle = min(idle, probe.cgroup_quota / ranks_per_node)
        reasons.append(_cores_reason(probe, idle, ranks_per_node, "none kept (not measured)"))
        workers, why = workers_for_loop(idle)
        reasons.append(why)
        return workers
    reserve = MAIN_PROCESS_CORES if main_cores is None else main_cores
    return _workers_from_cores(
        probe, sample_cost_s, consumer_rate, (ranks_per_node, reserve), reasons
    )


def _check_inputs(
    sample_cost_s: float,
    consumer_rate: float | None,
    batch_size: int,
    batch_bytes: int,
    ranks_per_node: int,
    main_cores: float,
) -> None:
    if not sample_cost_s >= 0:
        raise ValueError(f"sample_cost_s must be >= 0 seconds, got {sample_cost_s!r}")
    if consumer_rate is not None and not consumer_rate > 0:
        raise ValueError(f"consumer_rate must be > 0 samples/s or None, got {consumer_rate!r}")
    if batch_size < 1 or batch_bytes < 0:
        raise ValueError(f"need batch_size >= 1, batch_bytes >= 0, got {batch_size}, {batch_bytes}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node!r}")
    if not main_cores >= 0:
        raise ValueError(f"main_cores must be >= 0, got {main_cores!r}")


def _workers_from_cores(
    probe: Probe,
    sample_cost_s: float,
    consumer_rate: float | None,
    ranks: tuple[int, float],
    reasons: list[str],
) -> int:
    ranks_per_node, main_cores = ranks
    free = free_cores(probe, ranks_per_node, main_cores)
    reasons.append(_cores_reason(probe, free, ranks_per_node, f"minus {main_cores:g}"))
    if consumer_rate is None:
        needed = math.inf
        reasons.append(
            "consumer rate unknown: assume the loader is the bottleneck, use every free core"
        )
    else:
        load = consumer_rate * sample_cost_s
        if load <= MAIN_KEEPS_UP_SHARE:
            reasons.append(
                f"0 workers: the main process alone keeps up ({consumer_rate:.0f} samples/s x "
                f"{sample_cost_s * 1e6:.1f} us/sample = {load:.1%} of a core, "
                f"<= {MAIN_KEEPS_UP_SHARE:.0%})"
            )
            return 0
        needed = math.ceil(load)
        reasons.append(
            f"workers needed {needed} = ceil({consumer_rate:.0f} samples/s x "
            f"{sample_cost_s * 1e6:.1f} us/sample = {load:.2f} cores)"
        )
    workers = int(max(0, min(needed, math.floor(free), probe.usable_cores)))
    if workers == 0:
        reasons.append(f"0 workers: less than one free core ({free:.2f}); load in the main process")
    else:
        reasons.append(f"num_workers {workers} = min(needed, floor(free cores {free:.2f}))")
    return workers


def _cores_reason(probe: Probe, free: float, ranks_per_node: int, kept: str) -> str:
    """ "free cores ...: the usable cores, the others' load and what was kept for the loop."""
    others = sum(sorted(probe.busy_others)[: probe.usable_cores])
    quota = "" if probe.cgroup_quota is None else f", cgroup quota {probe.cgroup_quota:.2f} CPUs"
    per_rank = f" per rank ({ranks_per_node} ranks on this node)" if ranks_per_node > 1 else ""
    return (
        f"free cores {free:.2f}{per_rank}: {probe.usable_cores} usable cores (affinity "
        f"{len(probe.affinity)}{quota}) with {others:.2f} cores busy with other processes, "
        f"{kept} for the main process"
    )


def max_workers_by_memory(probe: Probe) -> int:
    """The most workers whose memory (per-worker RSS each) fits `WORKER_MEMORY_SHARE` of free
    memory."""
    return int(WORKER_MEMORY_SHARE * probe.available_bytes // max(1, probe.worker_rss_bytes))


def _cap_by_worker_memory(workers: int, probe: Probe, reasons: list[str]) -> int:
    capped = max_workers_by_memory(probe)
    if workers <= capped:
        return workers
    reasons.append(
        f"num_workers lowered {workers} -> {capped}: {workers} x "
        f"{probe.worker_rss_bytes / 2**20:.0f} MiB per worker exceeds {WORKER_MEMORY_SHARE:.0%} "
        f"of {probe.available_bytes / 2**30:.2f} GiB free memory"
    )
    return capped


def _prefetch_from_memory(
    workers: int,
    probe: Probe,
    batch_size: int,
    batch_bytes: int,
    batch_cost_cv: float,
    reasons: list[str],
) -> int:
    variable = batch_cost_cv > HIGH_VARIATION_CV
    target = VARIABLE_PREFETCH if variable else DEFAULT_PREFETCH
    why = (
        f"batch time varies (CV {batch_cost_cv:.2f} > {HIGH_VARIATION_CV})"
        if variable
        else f"batch time steady (CV {batch_cost_cv:.2f})"
    )
    if workers == 0:
        reasons.append(f"prefetch_factor {target} (unused with 0 workers): {why}")
        return target
    budget = PREFETCH_MEMORY_SHARE * probe.available_bytes
    prefetch = target
    while prefetch > 1 and workers * prefetch * batch_bytes > budget:
        prefetch //= 2
    queued = workers * prefetch * batch_bytes
    fits = "fits" if queued <= budget else "does NOT fit (1 is the least possible)"
    reasons.append(
        f"prefetch_factor {prefetch} (target {target}: {why}): {workers} workers x {prefetch} x "
        f"{batch_bytes / 2**20:.1f} MiB per batch of {batch_size} = {queued / 2**20:.0f} MiB {fits} in "
        f"{PREFETCH_MEMORY_SHARE:.0%} of {probe.available_bytes / 2**30:.2f} GiB free memory"
    )
    return prefetch
