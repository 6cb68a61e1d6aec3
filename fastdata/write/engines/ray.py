"""The shard writer's tasks on a Ray cluster (`fastdata shard ... --engine ray`).

Each task writes a slice of the writer's plan straight into the output folder, which every
node must reach at the same path (a shared file system); the driver merges the manifest once
at the end. A task whose worker dies is run again by Ray (`max_retries`): its shards are
written whole or not at all, so the result is the same bytes. Ray is imported only here, and
only when the engine starts: it is the optional extra `fastdata[ray]`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

from fastdata.write.engine import EngineUnavailableError, usable_cores
from fastdata.write.errors import ShardingError

__all__ = ["INSTALL_HINT", "RayEngine", "import_ray"]

log = logging.getLogger("fastdata")

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

INSTALL_HINT = 'the Ray engine needs Ray: pip install "fastdata[ray]"'
_TASKS_PER_CPU = 4  # more tasks than cores: a slow node does not hold the whole run back


def import_ray() -> ModuleType:
    """The `ray` module, or an `EngineUnavailableError` that says how to install it."""
    try:
        module = importlib.import_module("ray")
    except ImportError as exc:
        raise EngineUnavailableError(f"{INSTALL_HINT} ({exc})") from exc
    if module is None:  # sys.modules["ray"] = None: blocked
        raise EngineUnavailableError(INSTALL_HINT)
    return module


class RayEngine:
    """Runs the writer's tasks as Ray tasks (one CPU each).

    Args:
        address: the cluster to join (e.g. "auto", "ray://head:10001"); None joins the one
            $RAY_ADDRESS names, else starts a local cluster on the usable cores (no dashboard),
            shut down by `close`. When Ray is
            already initialized in this process, that cluster is used and left running.
        tasks: how many tasks to cut the plan into; None: four per CPU Ray reports.
        max_retries: how many times Ray runs a task again whose worker died.
        poll_s: how often the driver wakes while waiting for tasks (Ctrl-C stays responsive).

    Raises:
        EngineUnavailableError: Ray is not installed (when the engine starts).
    """

    shared_memory = False

    def __init__(
        self,
        address: str | None = None,
        tasks: int | None = None,
        max_retries: int = 3,
        poll_s: float = 1.0,
    ) -> None:
        if tasks is not None and tasks < 1:
            raise ValueError(f"tasks must be >= 1 or None, got {tasks}")
        self.address = address
        self.tasks = tasks
        self.max_retries = max_retries
        self.poll_s = poll_s
        self._ray: ModuleType | None = None
        self._owned = False
        import_ray()  # fail at once, not after the plan, when Ray is missing

    def start(self) -> ModuleType:
        """Join or start the cluster (once); returns the `ray` module."""
        if self._ray is not None:
            return self._ray
        ray = import_ray()
        if not ray.is_initialized():
            if self.address is not None:
                ray.init(address=self.address)
            elif os.environ.get("RAY_ADDRESS"):  # Ray's own way to name the cluster to join
                ray.init()
            else:
                ray.init(num_cpus=usable_cores(), include_dashboard=False)
            self._owned = True
        self._ray = ray
        return ray

    def close(self) -> None:
        """Shut down the cluster this engine started (not one it joined in-process)."""
        if self._ray is not None and self._owned:
            self._ray.shutdown()
        self._ray, self._owned = None, False

    def cpus(self) -> int:
        """The CPUs the cluster was given (`ray.cluster_resources()`), at least 1.

        Not `available_resources()`: that is the share free at this instant, lower while
        another job's tasks (or a killed driver's, being cancelled) still hold cores; the
        tasks queue for cores anyway.
        """
        ray = self.start()
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def tasks_for(self, jobs: int) -> int:
        """`tasks`, or four per CPU (at most one per job)."""
        return min(jobs, self.tasks or _TASKS_PER_CPU * self.cpus())

    def run(self, fn: Callable[[S, T], R], shared: S, tasks: Sequence[T]) -> Iterator[R]:
        """See `Engine.run`. `shared` goes to the object store once; tasks left when the caller
        stops (an error, Ctrl-C) are cancelled."""
        ray = self.start()
        remote = ray.remote(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)(fn)
        shared_ref = ray.put(shared)
        pending = [remote.remote(shared_ref, task) for task in tasks]
        log.info("ray: %d tasks on %d CPUs", len(pending), self.cpus())
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=self.poll_s)
                for ref in done:
                    yield _result(ray, ref, self.max_retries)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)


def _result(ray: ModuleType, ref: Any, retries: int) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.WorkerCrashedError as exc:
        raise ShardingError(
            f"a shard task's worker died {retries + 1} times ({exc}); its finished shards are "
            "kept: look at the Ray worker logs (out of memory?), then run the same command "
            "again to write the rest"
        ) from exc
