"""Sizing that follows the load: intra-op threads at start-up, and the re-check at each epoch end.

At start-up `choose_threads("auto", ...)` takes the cores other processes leave idle over 1 s.
One reading can be unlucky (another process used a core for a few seconds), so `LoaderMonitor`
re-checks at each training epoch's end with `recheck`: from the core load measured over the whole
epoch (`LoadMeter`: every CPU's busy time less this process tree's own, workers included) and the
epoch's data wait it sets the intra-op threads, workers and prefetch of the next epoch, and says
why in one line per change. `recheck` is a pure function of its inputs; tests give it readings.

Hysteresis: the thread count moves only when the idle cores per rank are more than
`HYSTERESIS_CORES` past the midpoint between two counts (1 -> 2 threads needs 1.75 idle cores,
2 -> 1 needs at most 1.25), and workers shrink only when the loader has slack, so noise of a
few tenths of a core does not flip the settings from epoch to epoch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from fastdata.tune.load import HYSTERESIS_CORES, CoreLoad, threads_for
from fastdata.tune.sizing import (
    HIGH_VARIATION_CV,
    MAIN_PROCESS_CORES,
    VARIABLE_PREFETCH,
    workers_for_loop,
)

__all__ = ["EpochFigures", "Recheck", "Sizing", "Trial", "recheck"]

log = logging.getLogger("fastdata")

#: Prefetched batches may use this share of free memory (as at start-up, `sizing`).
PREFETCH_MEMORY_SHARE = 0.25

#: How `_judge_trial` found the last worker change: none to judge, kept, kept with a gain worth
#: climbing on, or undone.
Verdict = Literal["none", "kept", "climb", "undone"]

#: A worker change kept with at least this gain in throughput is followed by one more step the
#: same way (`_follow_the_loop` step 2): the best count is found by climbing, not by the model
#: of cores alone. Below it the gain is within an epoch's noise and the count stays.
CLIMB_GAIN = 0.05


# ---------------------------------------------------------------------------------------------
# The epoch-boundary re-check
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """The settings `recheck` may change.

    Args:
        threads: torch intra-op threads; None when not managed (a GPU run, or fixed by the user).
        num_workers: loader worker processes; None when they cannot be resized.
        prefetch_factor: batches prefetched per worker.
    """

    threads: int | None
    num_workers: int | None
    prefetch_factor: int = 2


@dataclass(frozen=True)
class Trial:
    """A worker count set at an epoch end, to be judged by the next epoch's throughput.

    Args:
        before: the worker count before the change.
        before_samples_per_s: the throughput measured with it (the epoch that decided).
    """

    before: int
    before_samples_per_s: float


@dataclass(frozen=True)
class EpochFigures:
    """What `LoaderMonitor` measured over one training epoch.

    Args:
        epoch: the epoch's number.
        load: the cores' load over the epoch.
        data_wait_frac: share of step time spent waiting for the next batch.
        wait_s: mean data wait per step.
        compute_s: mean step time less its data wait.
        wait_cv: coefficient of variation of the per-step waits.
        batch_bytes: bytes of one batch (for the prefetch memory check; 0: unknown).
        available_bytes: free memory now (None: unknown, prefetch is not raised).
        previous_idle: idle cores at the last decision (start-up or last epoch), for the log.
        batch_cost_s: mean seconds the loader's makers spent reading and decoding a batch (the
            cpu backend's stage times; None: not reported, the workers follow the wait alone).
        samples_per_s: the epoch's training throughput (None: unknown, no trial is judged).
        trial: the worker change made at the last epoch end, which this epoch ran (or None).
        lost: worker counts that lost a trial in this run (not tried again).
    """

    epoch: int
    load: CoreLoad
    data_wait_frac: float
    wait_s: float
    compute_s: float
    wait_cv: float = 0.0
    batch_bytes: int = 0
    available_bytes: int | None = None
    previous_idle: float | None = None
    batch_cost_s: float | None = None
    samples_per_s: float | None = None
    trial: Trial | None = None
    lost: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Recheck:
    """The settings for the next epoch and one line per change (or per change not made).

    Args:
        sizing: the settings for the next epoch.
        changes: "epoch N: ... a -> b (why)" for each setting that changed.
        notes: what was considered and not done, and why (e.g. no free core for a worker).
        trial: the worker change to judge at the next epoch end (None: none made).
        lost: worker counts that lost a trial so far.
    """

    sizing: Sizing
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trial: Trial | None = None
    lost: frozenset[int] = frozenset()


def recheck(
    current: Sizing,
    figures: EpochFigures,
    threshold: float = 0.2,
    ranks_per_node: int = 1,
    max_workers: int | None = None,
) -> Recheck:
    """Settings for the next epoch from the epoch's core load and data wait.

    1. threads: `threads_for` the idle cores (with hysteresis), when managed.
    2. workers, data wait above `threshold`: as many as would have hidden the wait
       (one worker makes a batch in workers x (compute + wait) s; 0 workers: in `wait` s), at
       most the free cores (idle per rank less `MAIN_PROCESS_CORES`, plus `HYSTERESIS_CORES`) or
       `max_workers`; never fewer than now.
    3. workers, data wait below threshold / 2, and other processes took more than
       0.5 + `HYSTERESIS_CORES` cores since the last decision (`previous_idle`): down to those
       free cores when the workers exceed them by more than 0.5 + `HYSTERESIS_CORES`
       (oversubscribed workers slow the step down). Without such a change the count the loader
       kept up with stays: more workers than cores can be the faster choice for photos.
    4. prefetch: raised to `VARIABLE_PREFETCH` when the wait stays high, workers cannot grow,
       the waits vary (CV > `HIGH_VARIATION_CV`) and the deeper queue fits in memory.

    When the loader reports what a batch costs to make (`EpochFigures.batch_cost_s`), steps 2
    and 3 are replaced by the loop's measured load (`_follow_the_loop`).
    """
    out = Recheck(current)
    load, head = figures.load, f"epoch {figures.epoch}"
    idle = f"{load.idle_cores:.1f} of {load.usable_cores} cores idle"
    was = "" if figures.previous_idle is None else f", was {figures.previous_idle:.1f}"
    if current.threads is not None:
        threads = threads_for(load.idle_cores, ranks_per_node, load.usable_cores, current.threads)
        if threads != current.threads:
            out.changes.append(
                f"{head}: intra-op threads {current.threads} -> {threads} ({idle}{was})"
            )
            out = replace(out, sizing=replace(out.sizing, threads=threads))
    if current.num_workers is None:
        return out
    if figures.batch_cost_s is not None:
        return _follow_the_loop(out, figures, threshold, ranks_per_node, max_workers)
    return _follow_the_wait(out, figures, threshold, ranks_per_node, max_workers)


def _follow_the_wait(
    out: Recheck,
    figures: EpochFigures,
    threshold: float,
    ranks_per_node: int,
    max_workers: int | None,
) -> Recheck:
    """`recheck`'s steps 2-4: workers (and prefetch) from the data wait and the idle cores."""
    load, head = figures.load, f"epoch {figures.epoch}"
    idle = f"{load.idle_cores:.1f} of {load.usable_cores} cores idle"
    current = out.sizing
    assert current.num_workers is not None  # recheck returned earlier otherwise
    free = load.idle_cores / max(1, ranks_per_node) - MAIN_PROCESS_CORES
    cap = max(0, math.floor(free + HYSTERESIS_CORES))
    if max_workers is not None:
        cap = max_workers
    workers = current.num_workers
    if figures.data_wait_frac > threshold:
        wait = f"data wait {figures.data_wait_frac:.0%} of step time > {threshold:.0%}"
        target = max(workers, min(_workers_to_hide(workers, figures), cap))
        if target > workers:
            out.changes.append(f"{head}: workers {workers} -> {target} ({wait}; {idle})")
            return replace(out, sizing=replace(out.sizing, num_workers=target))
        out.notes.append(
            f"{head}: {wait}, but no free core is left for another worker ({workers} now; {idle})"
        )
        return _deeper_prefetch(out, figures, head)
    margin = 0.5 + HYSTERESIS_CORES if max_workers is None else 0.0
    oversubscribed = workers > cap and workers > free + margin
    before = figures.previous_idle
    took = before is not None and before - load.idle_cores > 0.5 + HYSTERESIS_CORES
    if figures.data_wait_frac < threshold / 2 and oversubscribed and took:
        out.changes.append(
            f"{head}: workers {workers} -> {cap} ({idle} leave {max(free, 0.0):.1f} for workers; "
            f"data wait {figures.data_wait_frac:.0%})"
        )
        return replace(out, sizing=replace(out.sizing, num_workers=cap))
    return out


def _workers_to_hide(current: int, figures: EpochFigures) -> int:
    """Workers that would have hidden the measured wait: at least one more than now."""
    compute = max(figures.compute_s, 1e-6)
    batch_time = figures.wait_s if current == 0 else current * (compute + figures.wait_s)
    return max(math.ceil(batch_time / compute), current + 1)


def _deeper_prefetch(out: Recheck, figures: EpochFigures, head: str) -> Recheck:
    sizing = out.sizing
    workers = sizing.num_workers or 0
    if workers == 0 or sizing.prefetch_factor >= VARIABLE_PREFETCH:
        return out
    if figures.wait_cv <= HIGH_VARIATION_CV or figures.available_bytes is None:
        return out
    queued = workers * VARIABLE_PREFETCH * figures.batch_bytes
    if queued > PREFETCH_MEMORY_SHARE * figures.available_bytes:
        return out
    out.changes.append(
        f"{head}: prefetch_factor {sizing.prefetch_factor} -> {VARIABLE_PREFETCH} (waits vary, "
        f"CV {figures.wait_cv:.2f} > {HIGH_VARIATION_CV}; {queued / 2**20:.0f} MiB queued fits)"
    )
    return replace(out, sizing=replace(sizing, prefetch_factor=VARIABLE_PREFETCH))


def _follow_the_loop(
    out: Recheck,
    figures: EpochFigures,
    threshold: float,
    ranks_per_node: int,
    max_workers: int | None,
) -> Recheck:
    """Workers from the loop's measured load, each change judged by the next epoch.

    1. The last epoch end's change (`figures.trial`) is kept when this epoch ran at least as
       fast as the epoch before it, else undone; the losing count is not gone back to while the
       load stays (a change of the idle cores by more than 0.5 + `HYSTERESIS_CORES` forgets
       it). A model of cores cannot see everything: on a machine shared with other processes,
       more runnable workers also get a larger share of the contended cores.
    2. A change kept with a gain above `CLIMB_GAIN` is followed by one more step the same way,
       whatever the wait (`_climb`): the count climbs to the best measured one and stops one
       past it, undone (with a core taken by another process 3 workers beat the 1 the wait
       asks for: `benchmarks/bench_auto_workers.py`).
    3. The target is `sizing.workers_for_loop` (the idle cores, the loop's compute per step, a
       batch's cost): up when the data wait passes half the threshold, down when it stays under
       the threshold, so both moves go towards the same target.
    4. At the target with the wait still above the threshold, one more worker is tried (its
       next epoch decides), unless that count lost before or exceeds `max_workers`.
    """
    head, load = f"epoch {figures.epoch}", figures.load
    workers = out.sizing.num_workers or 0
    before = figures.previous_idle
    moved = before is not None and abs(load.idle_cores - before) > 0.5 + HYSTERESIS_CORES
    # Trials lost under another load say nothing about this one.
    figures = replace(figures, lost=frozenset()) if moved else figures
    out = replace(out, lost=figures.lost)
    out, verdict = _judge_trial(out, figures, workers, head)
    if verdict == "undone":
        return out
    figures = replace(figures, lost=out.lost)
    limit = _worker_limit(load, ranks_per_node, max_workers)
    climbed = _climb(out, figures, workers, limit) if verdict == "climb" else None
    if climbed is not None:
        return climbed
    idle = load.idle_cores / max(1, ranks_per_node)
    target, why = workers_for_loop(idle, figures.batch_cost_s, figures.compute_s)
    if max_workers is not None:
        target = min(target, max_workers)
    wait = f"data wait {figures.data_wait_frac:.0%}"
    grow = target > workers and figures.data_wait_frac > threshold / 2
    shrink = target < workers and figures.data_wait_frac < threshold
    if (grow or shrink) and target not in figures.lost:
        out.changes.append(f"{head}: workers {workers} -> {target} ({wait}; {why})")
        return _tried(out, target, workers, figures)
    if figures.data_wait_frac > threshold and workers + 1 not in figures.lost and workers < limit:
        out.changes.append(
            f"{head}: workers {workers} -> {workers + 1} ({wait} > {threshold:.0%}; {why}; "
            "tried: kept if the next epoch is faster)"
        )
        return _tried(out, workers + 1, workers, figures)
    if figures.data_wait_frac > threshold:
        out.notes.append(f"{head}: {wait} > {threshold:.0%}, workers stay {workers} ({why})")
        return _deeper_prefetch(out, figures, head)
    return out


def _worker_limit(load: CoreLoad, ranks_per_node: int, max_workers: int | None) -> int:
    """The most workers a trial may set: `max_workers`, else twice this rank's share of the
    usable cores (each rank of a node climbs on its own)."""
    if max_workers is not None:
        return max_workers
    return max(1, 2 * load.usable_cores // max(1, ranks_per_node))


def _climb(out: Recheck, figures: EpochFigures, workers: int, limit: int) -> Recheck | None:
    """One more worker the way the last (kept, gaining) change went, as a trial (up after an
    increase, down after a decrease); None where that count lost before or leaves [0, limit]
    (`max_workers`, or twice this rank's share of the usable cores)."""
    assert figures.trial is not None  # a "climb" verdict judged one
    step = 1 if workers > figures.trial.before else -1
    if not 0 <= workers + step <= limit or workers + step in figures.lost:
        return None
    out.changes.append(
        f"epoch {figures.epoch}: workers {workers} -> {workers + step} (the last change gained "
        f"more than {CLIMB_GAIN:.0%}; tried: kept if the next epoch is faster)"
    )
    return _tried(out, workers + step, workers, figures)


def _tried(out: Recheck, workers: int, before: int, figures: EpochFigures) -> Recheck:
    trial = None
    if figures.samples_per_s is not None:
        trial = Trial(before, figures.samples_per_s)
    return replace(out, sizing=replace(out.sizing, num_workers=workers), trial=trial)


def _judge_trial(
    out: Recheck, figures: EpochFigures, workers: int, head: str
) -> tuple[Recheck, Verdict]:
    """The last change judged by this epoch's throughput: (out, "undone") with it undone when
    this epoch was slower than the one before it; else the count it beat added to `lost` (not
    gone back to) and (out, "climb") when it gained more than `CLIMB_GAIN`, (out, "kept") when
    less; (out, "none") when there was no change to judge."""
    trial, now = figures.trial, figures.samples_per_s
    if trial is None or now is None or trial.before == workers:
        return out, "none"
    if now >= trial.before_samples_per_s:
        out.notes.append(
            f"{head}: {workers} workers kept ({now:.0f} samples/s, {trial.before} workers "
            f"ran {trial.before_samples_per_s:.0f})"
        )
        gained = now > (1 + CLIMB_GAIN) * trial.before_samples_per_s
        return replace(out, lost=out.lost | {trial.before}), "climb" if gained else "kept"
    out.changes.append(
        f"{head}: workers {workers} -> {trial.before} ({workers} workers ran {now:.0f} "
        f"samples/s, {trial.before} ran {trial.before_samples_per_s:.0f}: undone)"
    )
    lost = out.lost | {workers}
    return replace(out, sizing=replace(out.sizing, num_workers=trial.before), lost=lost), "undone"
