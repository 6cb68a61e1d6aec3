"""Keeping the shard cache's folder within its limit: the `.cache.lock` section of
`fastdata.remote.cache.ShardCache` (rule 5 of its module docstring), eviction (rule 3), trimming
back to the limit, and the check that a limit can hold what the node's readers pin; a pin itself
(`CachedShard`, a shared lock on the shard) and the folder's bytes now (`folder_bytes`)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdata.remote.locks import LockFile

if TYPE_CHECKING:  # the manifest as remote/ sees it (remote/shards.py), named as its classes
    from fastdata.remote.config import Timeouts
    from fastdata.remote.shards import ShardEntry as ShardInfo
    from fastdata.remote.shards import ShardSource as Manifest

__all__ = ["CacheFolder", "CacheStats", "CachedShard", "folder_bytes"]

log = logging.getLogger(__name__)

_SHA = re.compile(r"^[0-9a-f]{64}$")
#: A download under way: `<sha>.tar.<bytes>.part` (a read), `<sha>.tar.<bytes>.ahead.part` (a
#: prefetch: its room frees itself, as an unpinned shard, once done), `<sha>.idx.part`.
_PART = re.compile(r"^([0-9a-f]{64})\.(?:tar\.(\d+)(\.ahead)?|idx)\.part$")
_POLL = 0.02  # seconds between looks at the folder while a read waits for prefetches to finish


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
        A read that does not fit while prefetches are under way waits for them (polled, at most
        `timeouts.lock` s): each becomes an unpinned shard, evictable, when done. Only when the
        pinned shards and the reads under way fill the limit (`check_limit` refuses such a
        limit up front) is it downloaded over the limit, with one warning per job.
        """
        protect = self._window if optional else frozenset()
        deadline = time.monotonic() + self.timeouts.lock
        while True:
            with self._room_lock():
                used, ahead = self._evict_until(shard.bytes, protect)
                fits = used + shard.bytes <= self.limit_bytes
                if not fits and optional:
                    return False
                if fits or not ahead or time.monotonic() > deadline:
                    if not fits and self._first_to_warn():
                        self._warn_over(manifest, shard, used)
                    part.touch()  # reserves the space: other makers of room count it from its name
                    return True
            time.sleep(_POLL)  # outside `.cache.lock`: the prefetches need it to finish

    def _evict_until(self, room: int, protect: frozenset[str]) -> tuple[int, int]:
        """Evict least recently used unpinned shards (not in `protect`) until `room` more bytes
        fit; (bytes then in use or reserved, bytes of those reserved by prefetches under way).
        Called holding `.cache.lock`."""
        entries, used, ahead = self._scan()
        for _, sha, size in sorted(entries):
            if used + room <= self.limit_bytes:
                break
            if sha not in protect and self._evict(sha):
                used -= size
        return used, ahead

    def trim(self) -> int:
        """Evict least recently used unpinned shards until the folder is within its limit (after
        reads that went over it); the bytes then in the folder's shards and downloads."""
        with self._room_lock():
            return self._evict_until(0, frozenset())[0]

    def check_limit(
        self, shard_bytes: int, readers: int, pins: int, who: str, whole: int | None = None
    ) -> None:
        """Refuse a limit below what the node's readers pin at once (MosaicML Streaming refuses
        such a limit too): each reader keeps up to `pins` shards of up to `shard_bytes` open.

        Args:
            shard_bytes: the biggest remote shard the readers read.
            readers: shard readers on the node that share this cache.
            pins: shards each keeps open at once (`fastdata.read.shardio.pins_needed`).
            who: what the readers are, for the message (e.g. "1 rank x 2 loader workers").
            whole: the bytes of every shard they read, if known: they cannot pin more.

        Raises:
            ValueError: the limit is below readers x pins x shard_bytes (or `whole`); the
                message names the size to set.
        """
        need = readers * pins * shard_bytes
        if whole is not None and whole < need:
            need, why = whole, f"every shard they read, {whole:,} bytes"
        else:
            why = f"{pins} shards of up to {shard_bytes:,} bytes each, {need:,} bytes"
        if self.limit_bytes >= need:
            return
        raise ValueError(
            f"the limit of {self.limit_bytes:,} bytes of the shard cache {self.cache_dir} "
            f"cannot hold what its readers pin: {readers} readers ({who}) keep {why} open. "
            f"Set the limit to at least {need:,} bytes (e.g. cache=CacheSettings(limit="
            f'"{-(-need // 10**6)}MB")), '
            "or use fewer loader workers (each reads through its own reader)"
        )

    def _warn_over(self, manifest: Manifest, shard: ShardInfo, used: int) -> None:
        log.warning(
            "shard cache %s: its limit is %d bytes, the shards that open readers pin or "
            "download hold %d, and %s (%s) needs %d more: it is read over the limit and "
            "prefetching pauses while the cache is full. Raise the cache limit above "
            "(readers on this node) x (shards each keeps open) x shard size "
            "(cache=CacheSettings(limit=...), or $FASTDATA_CACHE_LIMIT).",
            self.cache_dir,
            self.limit_bytes,
            used,
            shard.name,
            manifest.shard_url(shard),
            shard.bytes,
        )

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

    def _scan(self) -> tuple[list[tuple[float, str, int]], int, int]:
        """(mtime, sha, bytes) of each complete shard, the bytes in use or reserved, and the
        bytes of those reserved by prefetches under way."""
        entries: list[tuple[float, str, int]] = []
        used = ahead = 0
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
                        continue
                    size = int(match.group(2)) if match.group(2) else entry.stat().st_size
                    used += size
                    ahead += size if match.group(3) else 0
            except FileNotFoundError:  # renamed or removed by its owner meanwhile
                continue
        return entries, used, ahead

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


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of the files in `folder` now. Other processes of the node rename `.part` files and
    evict shards while it is listed: a file gone between the listing and its stat is not counted."""
    total = 0
    for entry in os.scandir(folder):
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except FileNotFoundError:  # renamed or removed by its owner meanwhile
            continue
    return total


class CachedShard:
    """A shard in the cache, pinned (never evicted) until `release()` or the end of a `with`.

    Attributes:
        tar: the shard's local file.
        index: its DALI index, or None when the store has none (scan the tar instead).
    """

    def __init__(self, lock: LockFile, tar: Path, index: Path | None) -> None:
        self._lock: LockFile | None = lock
        self.tar = tar
        self.index = index

    def release(self) -> None:
        """Unpin (closing the lock file releases the shared lock). Safe to call twice."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CachedShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
