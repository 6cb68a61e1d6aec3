"""Cluster engines for the shard writer (`fastdata.write.engine`), each behind an optional extra.

engine = open_engine("ray", address="ray://head:10001")   # or None: a local Ray cluster
write_shards(source, "/shared/out", options, engine=engine)
"""

from __future__ import annotations

from fastdata.write.engine import Engine, EngineUnavailableError, LocalEngine

__all__ = ["ENGINES", "EngineUnavailableError", "open_engine"]

#: `fastdata shard --engine` names; "ray" needs the `fastdata[ray]` extra.
ENGINES = ("local", "ray")


def open_engine(
    name: str | Engine | None,
    *,
    workers: int | None = None,
    address: str | None = None,
    tasks: int | None = None,
) -> Engine:
    """The engine called `name`, or `name` itself when it is an engine.

    Args:
        name: "local" (or None): processes forked on this machine; "ray": a Ray cluster.
        workers: the local engine's processes (None: the usable cores).
        address: the Ray cluster to join (None: start a local one on the usable cores).
        tasks: how many Ray tasks to cut the plan into (None: four per core Ray reports).

    Raises:
        ValueError: an unknown engine name.
        EngineUnavailableError: "ray" without Ray installed.
    """
    if name is None or name == "local":
        return LocalEngine(workers)
    if not isinstance(name, str):
        return name
    if name == "ray":
        from fastdata.write.engines.ray import RayEngine

        return RayEngine(address=address, tasks=tasks)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
