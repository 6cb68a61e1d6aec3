"""What the shard cache reads of a manifest: an interface, so that remote/ imports nothing above it.

`fastdata.format.manifest.Manifest` and `ShardInfo` meet these protocols by their fields and
methods (tests/test_layers.py checks it); remote/ sits below format/ (docs/DESIGN.md, "Layers"),
so it names what it needs here instead of importing those classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["ShardEntry", "ShardSource", "SplitEntries"]


class ShardEntry(Protocol):
    """One shard of a manifest (`fastdata.format.manifest.ShardInfo`)."""

    @property
    def name(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def sha256(self) -> str: ...

    @property
    def index_sha256(self) -> str | None: ...


class SplitEntries(Protocol):
    """One split of a manifest (`fastdata.format.manifest.SplitInfo`)."""

    @property
    def shards(self) -> Sequence[ShardEntry]: ...


class ShardSource(Protocol):
    """A manifest (`fastdata.format.manifest.Manifest`): its root, splits and file URLs."""

    @property
    def root(self) -> str: ...

    @property
    def splits(self) -> Mapping[str, SplitEntries]: ...

    def shard_url(self, shard: ShardEntry) -> str: ...

    def index_url(self, shard: ShardEntry) -> str: ...
