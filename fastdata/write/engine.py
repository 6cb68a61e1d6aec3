"""Where the shard writer's tasks run: this machine's processes, or a cluster engine.

The writer's plan (`fastdata.write.plan.plan_jobs`) is a pure function of the source and
the options, and each shard commits atomically with a `done` record. So writing is a list of
independent, idempotent tasks: an engine only has to run them somewhere and hand back their
results as they finish. `LocalEngine` forks processes on this machine (the writer's own path);
`fastdata.write.engines.ray.RayEngine` runs the same tasks on a Ray cluster. Another engine
(Dask, Spark) is an adapter of the same two methods.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Engine", "EngineUnavailableError", "LocalEngine", "usable_cores"]

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")


class EngineUnavailableError(ImportError):
    """The engine's package is not installed (the message says how to install it)."""


@runtime_checkable
class Engine(Protocol):
    """Runs picklable, idempotent tasks and yields their results as they finish.

    `shared_memory` tells the writer whether tasks run in processes forked from the caller
    (they may then share a counter with it), or elsewhere (each task counts for itself).
    """

    shared_memory: bool

    def cpus(self) -> int:
        """How many tasks run at once (the cores the engine was given, not this machine's)."""
        ...

    def tasks_for(self, jobs: int) -> int:
        """Into how many tasks to cut `jobs` shard jobs."""
        ...

    def close(self) -> None:
        """Release what the engine started (a local cluster); it may start again after."""
        ...

    def run(self, fn: Callable[[S, T], R], shared: S, tasks: Sequence[T]) -> Iterator[R]:
        """Call ``fn(shared, task)`` for every task, anywhere; yield the results in the order
        they finish. `shared` is sent once per worker, not once per task. A task that raises
        stops the run: the exception is raised here."""
        ...


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# The shared object is handed to forked workers through this global: forking shares its
# arrays copy-on-write, where pickling a 150 MB CIFAR array to every process would not.
_FORKED: dict[str, Any] = {}


class LocalEngine:
    """Tasks in processes forked from this one (or in this process for one worker).

    Args:
        workers: processes; None uses the usable cores.
    """

    shared_memory = True

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def cpus(self) -> int:
        """`workers`, or the usable cores."""
        return self.workers or usable_cores()

    def tasks_for(self, jobs: int) -> int:
        """One shard a task: forked processes cost nothing to hand a task to."""
        return jobs

    def close(self) -> None:
        """Nothing to release: each `run` ends its pool."""

    def run(self, fn: Callable[[S, T], R], shared: S, tasks: Sequence[T]) -> Iterator[R]:
        """See `Engine.run`; the pool is terminated when the caller stops early or fails."""
        workers = max(1, min(self.cpus(), len(tasks)))
        if workers == 1:
            for task in tasks:
                yield fn(shared, task)
            return
        _FORKED.update(fn=fn, shared=shared)
        try:
            with mp.get_context("fork").Pool(workers) as pool:
                yield from pool.imap_unordered(_call_forked, tasks)
        finally:
            _FORKED.clear()


def _call_forked(task: Any) -> Any:
    return _FORKED["fn"](_FORKED["shared"], task)
