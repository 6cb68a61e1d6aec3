"""Keeping the shard cache's folder within its limit: the `.cache.lock` section of
`fastdata.remote.cache.ShardCache` (rule 5 of its module docstring), and eviction (rule 3)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdata.remote.locks import LockFile

if TYPE_CHECKING:  # the manifest as remote/ sees it (remote/shards.py), named as its classes
    from fastdata.remote.config import Timeouts
    from fastdata.remote.shards import ShardEntry as ShardInfo
    from fastdata.remote.shards import ShardSource as Manifest

__all__ = ["CacheFolder", "CacheStats"]

log = logging.getLogger(__name__)

_SHA = re.compile(r"^[0-9a-f]{64}$")
_PART = re.compile(r"^([0-9a-f]{64})\.(?:tar\.(\d+)|idx)\.part$")


@dataclass
class CacheStats:
    """What this process's cache did (not shared between processes)."""

    downloads: int = 0
    bytes_fetched: int = 0
    hits: int = 0
    evictions: int = 0


class CacheFolder:
    """Making room in the cache folder; mixed into `ShardCache`, which sets the attributes."""

    cache_dir: Path
    limit_bytes: int
    timeouts: Timeouts
    stats: CacheStats
    _window: frozenset[str]
    _warned: bool

    def _room_lock(self) -> _Held:
        """`.cache.lock`, held exclusively for the `with` block (polled, with a deadline)."""
        lock = LockFile(self.cache_dir / ".cache.lock")
        try:
            lock.wait(
                lambda: lock.try_lock(fcntl.LOCK_EX),
                self.timeouts.lock,
                f"the shard cache {self.cache_dir}",
            )
        except BaseException:
            lock.close()
            raise
        return _Held(lock)

    def _make_room(self, manifest: Manifest, shard: ShardInfo, part: Path, optional: bool) -> bool:
        """Rule 5: evict least recently used shards until this one fits; reserve its space.

        An optional download (a prefetch) evicts no shard of the plan's next ones, and is not
        made (False) when it does not fit: prefetching never pushes the cache past its limit.
        """
        protect = self._window if optional else frozenset()
        with self._room_lock():
            entries, used = self._scan()
            for _, sha, size in sorted(entries):
                if used + shard.bytes <= self.limit_bytes:
                    break
                if sha not in protect and self._evict(sha):
                    used -= size
            if used + shard.bytes > self.limit_bytes and optional:
                return False
            if used + shard.bytes > self.limit_bytes and self._first_to_warn():
                log.warning(
                    "shard cache %s: its limit is %d bytes, the shards that open readers pin or "
                    "download hold %d, and %s (%s) needs %d more: it is read over the limit and "
                    "prefetching pauses while the cache is full. Raise cache_limit above "
                    "(readers on this node) x (shards each keeps open + prefetches) x shard size.",
                    self.cache_dir,
                    self.limit_bytes,
                    used,
                    shard.name,
                    manifest.shard_url(shard),
                    shard.bytes,
                )
            part.touch()  # reserves the space: other makers of room count it from its name
        return True

    def _first_to_warn(self) -> bool:
        """True once per job for this cache: the first of its processes (main process, loader
        workers, ranks of one process group) to find the limit too small warns; the rest don't.
        Called holding `.cache.lock`."""
        if self._warned:
            return False
        self._warned = True
        marker = self.cache_dir / f".warned-{self.limit_bytes}-{os.getpgid(0)}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            return False
        return True

    def _scan(self) -> tuple[list[tuple[float, str, int]], int]:
        """(mtime, sha, bytes) of each complete shard, and the bytes in use or reserved."""
        entries: list[tuple[float, str, int]] = []
        used = 0
        for entry in os.scandir(self.cache_dir):
            name = entry.name
            try:
                if name.endswith(".tar") and _SHA.match(name[:-4]):
                    stat = entry.stat()
                    idx = self.cache_dir / (name[:-4] + ".idx")
                    size = stat.st_size + (idx.stat().st_size if idx.exists() else 0)
                    entries.append((stat.st_mtime, name[:-4], size))
                    used += size
                elif match := _PART.match(name):
                    if self._stale(match.group(1)):
                        Path(entry.path).unlink(missing_ok=True)
                    else:
                        used += int(match.group(2)) if match.group(2) else entry.stat().st_size
            except FileNotFoundError:  # renamed or removed by its owner meanwhile
                continue
        return entries, used

    def _stale(self, sha: str) -> bool:
        """A .part whose shard lock nobody holds was left by a process that died mid-download."""
        return self._try_exclusive(sha, lambda: None)

    def _evict(self, sha: str) -> bool:
        def delete() -> None:
            for ext in ("tar", "idx"):
                (self.cache_dir / f"{sha}.{ext}").unlink(missing_ok=True)
            self.stats.evictions += 1

        return self._try_exclusive(sha, delete)

    def _try_exclusive(self, sha: str, action: Any) -> bool:
        """Run `action` holding the shard's lock exclusively, if that is possible without waiting."""
        lock = LockFile(self.cache_dir / f"{sha}.lock")
        try:
            if not lock.try_lock(fcntl.LOCK_EX):
                return False  # pinned by a reader, or being downloaded
            action()
        finally:
            lock.close()
        return True


class _Held:
    """A held LockFile as a context manager: closed (released) at the end of the block."""

    def __init__(self, lock: LockFile) -> None:
        self.lock = lock

    def __enter__(self) -> LockFile:
        return self.lock

    def __exit__(self, *exc: object) -> None:
        self.lock.close()
