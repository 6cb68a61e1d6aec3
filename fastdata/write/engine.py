"""Where the shard writer's tasks run: this machine's processes, or a cluster engine.

The writer's plan (`fastdata.write.plan.plan_jobs`) is a pure function of the source and
the options, and each shard commits atomically with a `done` record. So writing is a list of
independent, idempotent tasks: an engine only has to run them somewhere and hand back their
results as they finish. `LocalEngine` forks processes on this machine (the writer's own path);
`fastdata.write.engines.ray.RayEngine` runs the same tasks on a Ray cluster. Another engine
(Dask, Spark) is an adapter of the same two methods.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from fastdata._util.procs import run_in_processes

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


class LocalEngine:
    """Tasks in processes started from this one (or in this process for one worker).

    The processes are `fastdata._util.procs.run_in_processes`'s: forked (the source's arrays
    shared copy-on-write); they end without relying on SIGTERM, die with this process, and a
    worker that dies mid-task is an error, never a wait.

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
        """See `Engine.run`; the workers are ended when the caller stops early or fails."""
        workers = max(1, min(self.cpus(), len(tasks)))
        if workers == 1:
            for task in tasks:
                yield fn(shared, task)
            return
        for _index, result in run_in_processes(fn, shared, tasks, workers, describe=_shards):
            yield result


def _shards(task: object) -> str:
    """A writer task (a list of shard jobs) by its shards' names, for errors."""
    stems = [getattr(job, "stem", None) for job in task] if isinstance(task, list) else []
    if stems and all(stems):
        return f"writing {', '.join(map(str, stems[:4]))}{' ...' if len(stems) > 4 else ''}"
    return repr(task)
