"""A node-local cache of remote shards, shared by every rank and DataLoader worker of the node.

Layout of `cache_dir` (content-addressed by the manifest's sha256, so two datasets that share a
shard share its file, and a re-written dataset never reads a stale one):

    <sha256>.tar                 a complete shard, checked against the manifest's size and sha256
    <sha256>.idx                 its DALI index (absent when the store has none)
    <sha256>.tar.<bytes>.part    a download under way (renamed to .tar once checked)
    <sha256>.tar.<bytes>.ahead.part  the same, of a prefetch
    <sha256>.lock                the shard's lock file (kept: deleting a lock file races)
    .cache.lock                  held while making room, so two makers of room never both count it
    .warned-<limit>-<pgid>       marks that one process of a job warned the limit is too small

Rules, each enforced with `flock` through `fastdata.remote.locks.LockFile`:
1. One download per shard per node: a downloader holds the shard's lock exclusively; anyone who
   wants the shard meanwhile polls the lock, then finds the `.tar` in place.
2. Nothing partial is read: a shard is fetched under a `.part` name, checked, then renamed.
3. A reader pins the shards it has open with a shared lock; eviction only takes shards whose lock
   it can get exclusively (without waiting), so a pinned shard is never deleted. A downloader
   turns its exclusive lock into the reader's pin while holding `.cache.lock`, so no evicter
   can take the shard between its download and its first read.
4. Least recently used first: every use sets the `.tar`'s mtime; eviction goes by oldest mtime.
5. The folder stays within `limit_bytes`: before a download, under `.cache.lock`, old shards are
   evicted until the shards present plus the downloads under way plus this one fit. A prefetch
   that does not fit is not made; a read that does not fit waits (bounded) for the prefetches
   under way, which become evictable shards. Readers pace themselves: each keeps at most the
   shards a batch needs pinned (`fastdata.read.shardio.pins_needed`), and `check_limit` (called
   by the DataModule's `setup()`) refuses a limit below readers x pins x shard size. Should the
   pinned shards fill the limit anyway, the read goes over it (never a hang) with one warning per
   job giving the numbers; `trim()` (called when a reader closes) brings the folder back.

Locking rules (why nothing here hangs):
- No wait is blocking: every lock is polled without blocking until a deadline
  (`Timeouts.lock`, pushed back while the holder's download grows), then `LockTimeout` names the
  lock file, the shard and URL, and the pids holding it.
- No lock outlives a fork: a child process closes, at once, every lock descriptor it inherited
  (`os.register_at_fork` in `fastdata.remote.locks`); a DataLoader forking its workers while
  this process's prefetch thread downloads leaves the lock to the parent alone.
- Locks are held in short sections only: a shard's exclusive lock while it downloads (and
  `.cache.lock` inside that, while evicting), a shared pin while a reader has the shard open.
  The prefetch thread never waits for a lock: a shard locked by anyone else is left to them.
- The prefetch thread waits for work at most `_IDLE` seconds, then ends (a new one starts with
  the next job).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdata.remote.config import (
    CACHE_LIMIT_ENV,
    DEFAULT_LIMIT,
    DEFAULT_TIMEOUTS,
    Timeouts,
    default_cache_dir,
    parse_size,
)
from fastdata.remote.fs import download
from fastdata.remote.locks import LockFile
from fastdata.remote.retry import DEFAULT_RETRY, RemoteError, RetryPolicy

# CacheStats and CachedShard: re-exported (`fastdata.remote` and this module name them)
from fastdata.remote.room import CachedShard, CacheFolder, CacheStats, folder_bytes

if TYPE_CHECKING:  # the manifest as remote/ sees it (remote/shards.py), named as its classes
    from fastdata.remote.shards import ShardEntry as ShardInfo
    from fastdata.remote.shards import ShardSource as Manifest

__all__ = ["CacheStats", "CachedShard", "ShardCache"]

log = logging.getLogger(__name__)

_SHA = re.compile(r"^[0-9a-f]{64}$")
_IDLE = 30.0  # seconds the prefetch thread waits for a job before it ends


class ShardCache(CacheFolder):
    """Remote shards streamed through a bounded local folder (see the module docstring).

    Picklable: a DataLoader worker gets a copy that opens its own locks and prefetch thread.

    Args:
        cache_dir: the node-local folder (created); give every rank of a node the same one.
        limit_bytes: most bytes the folder holds, as bytes or a size such as "50GB".
        storage_options: passed to fsspec (e.g. `{"endpoint_url": ...}` for an S3-compatible
            store, `{"anon": True}` for a public bucket).
        retry: attempts and backoff for transient failures.
        timeouts: connect and read timeouts of each request, and the longest wait on a lock
            held by another process that makes no progress; None: `Timeouts.from_env()`
            (10 s, 30 s and 120 s unless $FASTDATA_CONNECT/READ/LOCK_TIMEOUT say otherwise).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        limit_bytes: int | str = DEFAULT_LIMIT,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir).expanduser()
        self.limit_bytes = parse_size(limit_bytes)
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        self.timeouts = timeouts or Timeouts.from_env()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._reset()

    @classmethod
    def default(cls) -> ShardCache:
        """The cache a remote manifest gets when none is given: `default_cache_dir()`, limited to
        `$FASTDATA_CACHE_LIMIT` or 50 GB."""
        return cls(default_cache_dir(), os.environ.get(CACHE_LIMIT_ENV, DEFAULT_LIMIT))

    def _reset(self) -> None:
        self.stats = CacheStats()
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Manifest, ShardInfo]] | None = None
        self._queued: set[str] = set()
        self._plan: tuple[str, dict[str, int], list[ShardInfo], int] | None = None
        self._window: frozenset[str] = frozenset()  # sha256 of the shards the plan reads next
        self._warned = False
        self._prefetch_failed: dict[str, RemoteError] = {}  # sha256 -> why its prefetch failed
        self._failed_this_plan: set[str] = set()  # not prefetched again until the next plan

    def __getstate__(self) -> dict[str, Any]:
        keep = ("cache_dir", "limit_bytes", "storage_options", "retry", "timeouts")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("timeouts", DEFAULT_TIMEOUTS)
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"ShardCache({str(self.cache_dir)!r}, limit_bytes={self.limit_bytes})"

    # --- reading -----------------------------------------------------------------------------

    def acquire(self, manifest: Manifest, shard: ShardInfo) -> CachedShard:
        """The shard's local files, downloaded first if needed, pinned until released.

        Raises:
            RemoteError: the shard cannot be downloaded intact (names the URL and what to do).
            LockTimeout: another process of the node holds the shard's lock and makes no
                progress for `timeouts.lock` seconds (names the lock file and the pids).
        """
        pin = self._pin(manifest, shard)
        self._prefetch_after(manifest, shard)
        return pin

    def fetch(self, manifest: Manifest, shard: ShardInfo) -> Path:
        """Download the shard into the cache unless it is there (without pinning it)."""
        self._pin(manifest, shard).release()
        return self._path(shard, "tar")

    def _pin(self, manifest: Manifest, shard: ShardInfo) -> CachedShard:
        """Rules 1-3: a shared lock on a present `.tar`, downloading it first if it is absent."""
        self._check(manifest, shard)
        tar, idx = self._path(shard, "tar"), self._path(shard, "idx")
        what = f"shard {shard.name} ({manifest.shard_url(shard)})"
        lock = LockFile(self._path(shard, "lock"))
        fetched = False

        def attempt() -> bool:
            nonlocal fetched
            if (failed := self._prefetch_failed.pop(shard.sha256, None)) is not None:
                raise failed  # the prefetch thread went through every retry: once is enough
            if lock.try_lock(fcntl.LOCK_SH) and tar.exists():
                return True
            if not lock.try_lock(fcntl.LOCK_EX):
                return False  # another process downloads (or evicts) it: poll again
            if tar.exists():  # downloaded meanwhile: take the pin on the next try
                lock.unlock()
                return False
            self._download(manifest, shard, optional=False)
            fetched = True
            # Rule 3: the exclusive lock becomes a pin with no evicter in between (a flock
            # conversion is not atomic); anyone else who takes the lock meanwhile lets go at once.
            with self._room_lock():
                lock.wait(lambda: lock.try_lock(fcntl.LOCK_SH), self.timeouts.lock, what)
            return tar.exists()

        try:
            lock.wait(attempt, self.timeouts.lock, what, progress=lambda: self._progress(shard))
            os.utime(tar)  # rule 4: the newest mtime is the latest use
        except BaseException:
            lock.close()
            raise
        self.stats.hits += not fetched
        return CachedShard(lock, tar, idx if idx.exists() else None)

    def _progress(self, shard: ShardInfo) -> tuple[int, ...]:
        """What another process's download of `shard` has written so far (a token that changes
        while it moves)."""
        for optional in (False, True):
            try:
                stat = os.stat(self._part(shard, optional))
            except FileNotFoundError:
                continue
            return stat.st_size, stat.st_mtime_ns
        return ()

    def _prefetch_one(self, manifest: Manifest, shard: ShardInfo) -> None:
        """Download ahead unless present or locked by anyone (never waits for a lock); skipped
        when it does not fit without evicting a shard the plan reads sooner."""
        tar = self._path(shard, "tar")
        lock = LockFile(self._path(shard, "lock"))
        try:
            if lock.try_lock(fcntl.LOCK_EX) and not tar.exists():
                self._download(manifest, shard, optional=True)
        except RemoteError as exc:  # recorded before the lock goes: a waiting reader sees it
            self._failed_this_plan.add(shard.sha256)
            self._prefetch_failed[shard.sha256] = exc
            raise
        finally:
            lock.close()

    def size_bytes(self) -> int:
        """Bytes in the cache folder now (shards, indexes and downloads under way)."""
        return folder_bytes(self.cache_dir)

    # --- prefetching -------------------------------------------------------------------------

    def prefetch(
        self, manifest: Manifest, shards: Sequence[ShardInfo | str], ahead: int = 2
    ) -> None:
        """Download ahead of the reader: `shards` is the order this process will read them in.

        Starts the first `ahead` now, in a background thread; each time `acquire` reaches a shard
        of the list, the `ahead` shards after it are queued. One order per process (a new call
        replaces it); a worker process calls this with its own order. A download that fails
        after every retry is raised by the next `acquire` of the shard (once, not tried again).
        """
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        infos = [self._info(manifest, s) for s in shards]
        with self._mutex:
            self._failed_this_plan.clear()
            self._plan = (manifest.root, {s.name: i for i, s in enumerate(infos)}, infos, ahead)
            self._window = frozenset(s.sha256 for s in infos[: ahead + 1])
        for info in infos[:ahead]:
            self._enqueue(manifest, info)

    def _prefetch_after(self, manifest: Manifest, shard: ShardInfo) -> None:
        plan = self._plan
        if plan is None or plan[0] != manifest.root or shard.name not in plan[1]:
            return
        position, infos, ahead = plan[1][shard.name], plan[2], plan[3]
        self._window = frozenset(s.sha256 for s in infos[position : position + 1 + ahead])
        for info in infos[position + 1 : position + 1 + ahead]:
            self._enqueue(manifest, info)

    def _enqueue(self, manifest: Manifest, shard: ShardInfo) -> None:
        if self._path(shard, "tar").exists():
            return
        with self._mutex:
            if self._pid != os.getpid():  # forked: the parent's thread is not here
                self._reset()
            if shard.sha256 in self._queued or shard.sha256 in self._failed_this_plan:
                return
            self._queued.add(shard.sha256)
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                # A daemon thread: exiting never waits for queued downloads (a cut one leaves a
                # .part that the next maker of room removes).
                threading.Thread(
                    target=self._prefetch_loop,
                    args=(self._queue,),
                    daemon=True,
                    name="fastdata-prefetch",
                ).start()
            self._queue.put((manifest, shard))

    def _prefetch_loop(self, jobs: queue.SimpleQueue[tuple[Manifest, ShardInfo]]) -> None:
        while True:
            try:
                manifest, shard = jobs.get(timeout=_IDLE)
            except queue.Empty:
                with self._mutex:
                    if jobs.empty():  # idle: end; the next job starts a new thread
                        if self._queue is jobs:
                            self._queue = None
                        return
                continue
            try:
                self._prefetch_one(manifest, shard)
            except Exception as exc:  # the reader's acquire() raises or retries it
                log.debug("prefetch of %s failed: %s", shard.name, exc)
            finally:
                with self._mutex:
                    self._queued.discard(shard.sha256)

    # --- downloading and making room ---------------------------------------------------------

    def _download(self, manifest: Manifest, shard: ShardInfo, optional: bool) -> None:
        """Fetch, check and rename into place; called holding the shard's exclusive lock."""
        part = self._part(shard, optional)
        idx_part = self.cache_dir / f"{shard.sha256}.idx.part"
        if not self._make_room(manifest, shard, part, optional):
            log.debug("prefetch of %s skipped: the cache is full of shards read sooner", shard.name)
            return
        try:
            has_index = self._fetch_files(manifest, shard, part, idx_part)
            if has_index:
                os.replace(idx_part, self._path(shard, "idx"))
            os.replace(part, self._path(shard, "tar"))  # rule 2: the .tar appears complete
        finally:
            idx_part.unlink(missing_ok=True)  # both gone after a success: no-ops then
            part.unlink(missing_ok=True)
        self.stats.downloads += 1

    def _fetch_files(
        self, manifest: Manifest, shard: ShardInfo, part: Path, idx_part: Path
    ) -> bool:
        """Download the index (if the store has one) and the tar; True when there is an index."""
        options = dict(storage_options=self.storage_options, retry=self.retry)
        options["timeouts"] = self.timeouts
        has_index = True
        try:
            # Checked like the tar where the manifest records the index's sha256 (format 2): a
            # cut or wrong body is fetched again, never kept for every later reader of the node.
            self.stats.bytes_fetched += download(
                manifest.index_url(shard), idx_part, sha256=shard.index_sha256, **options
            )
        except FileNotFoundError:
            log.info("%s has no index file; the reader scans the tar", manifest.index_url(shard))
            has_index = False
        url = manifest.shard_url(shard)
        try:
            self.stats.bytes_fetched += download(
                url, part, size=shard.bytes, sha256=shard.sha256, **options
            )
        except FileNotFoundError as exc:
            raise RemoteError(
                url,
                "the manifest lists this shard but the store has no such object",
                "The dataset was changed or partly deleted: shard it again.",
            ) from exc
        return has_index

    # --- helpers -----------------------------------------------------------------------------

    def _path(self, shard: ShardInfo, ext: str) -> Path:
        return self.cache_dir / f"{shard.sha256}.{ext}"

    def _part(self, shard: ShardInfo, optional: bool) -> Path:
        """The tar's name while it downloads; a prefetch's says so (`room._PART`)."""
        ahead = ".ahead" if optional else ""
        return self.cache_dir / f"{shard.sha256}.tar.{shard.bytes}{ahead}.part"

    @staticmethod
    def _check(manifest: Manifest, shard: ShardInfo) -> None:
        if not _SHA.match(shard.sha256):
            raise RemoteError(
                manifest.shard_url(shard),
                f"the manifest's sha256 {shard.sha256!r} is not a hex digest",
                "Shard the dataset again with this fastdata.",
            )

    @staticmethod
    def _info(manifest: Manifest, shard: ShardInfo | str) -> ShardInfo:
        if not isinstance(shard, str):  # a ShardInfo (only its type is imported here)
            return shard
        for split in manifest.splits.values():
            for info in split.shards:
                if info.name == shard:
                    return info
        raise ValueError(f"shard {shard!r} is not in the manifest at {manifest.root}")
