"""Reading samples out of shards by their index: random access without scanning tars.

The DALI index written beside each shard (`fastdata.read.shard_index`) gives every component's
byte offset and size, so a sample is one slice of a memory-mapped file. Remote shards (s3://,
gs://, https://) are read the same way from a node-local `fastdata.remote.ShardCache`:
downloaded once per node, checked against the manifest's sha256, then memory-mapped like local
shards.

Every read is checked against untrusted files (`fastdata.format.integrity`): files are opened only
as regular files, the index against the manifest's `index_sha256` when it is loaded, each
component against its tar header, each label against the class list, and with
`verify_samples=True` each sample against its digest written at shard time.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fastdata.format.integrity import (  # ShardReadError: re-exported, its old home
    IntegrityError,
    SampleSums,
    ShardReadError,
    check_header,
    label_problem,
    load_sums,
    open_regular,
    scan_shard,
)
from fastdata.format.manifest import Manifest, ShardInfo
from fastdata.read.shard_index import ShardIndex, check_index_count, load_index

if TYPE_CHECKING:  # fastdata.remote is imported only for remote datasets
    from fastdata.remote import CachedShard, ShardCache

__all__ = [
    "LOCAL_OPEN_LIMIT",
    "REMOTE_OPEN",
    "open_limit",
    "ShardReadError",
    "ShardReader",
    "pins_needed",
    "read_sample",
]


#: Remote shards a reader keeps pinned per dataset it reads: a batch of the plan lies within two
#: consecutive shards of each dataset (plan rules 0-1), and each stream reads its shards in turn.
PINS_PER_DATASET = 2


#: Local shards one reader keeps open at most. An open local shard is memory-mapped: it costs a
#: file descriptor and its parsed index, not its bytes; re-opening one parses and checks its
#: index again (CIFAR-100's 10,000-sample shards: ~30 ms). A shuffle window spanning many shards
#: reads from all of them in every batch, so the reader keeps every shard of a split open up to
#: this many (a quarter of the process's file-descriptor limit where that is lower).
LOCAL_OPEN_LIMIT = 256
#: Remote shards are pinned in the node's cache while open: few at once (see `pins_needed`).
REMOTE_OPEN = 8


def open_limit(manifest: Manifest, split: str) -> int:
    """The shards a `ShardReader` of `split` keeps open by default: every local shard of the
    split, up to `LOCAL_OPEN_LIMIT` (and a quarter of RLIMIT_NOFILE); remote: `REMOTE_OPEN`."""
    if "://" in manifest.root:
        return REMOTE_OPEN
    limit = LOCAL_OPEN_LIMIT
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            limit = min(limit, max(8, soft // 4))
    except (ImportError, OSError, ValueError):  # not POSIX: keep the default
        pass
    return max(1, min(limit, len(manifest.split(split).shards)))


def pins_needed(manifest: Manifest) -> int:
    """Remote shards one `ShardReader` of `manifest` keeps pinned in the cache at most: two per
    dataset (a mix reads one stream per dataset at once)."""
    source = manifest.source if isinstance(manifest.source, dict) else {}
    datasets = source.get("datasets") if source.get("kind") == "mix" else None
    return PINS_PER_DATASET * (len(datasets) if isinstance(datasets, list) and datasets else 1)


class ShardReader:
    """Open shards of one manifest and return sample components by (shard number, index).

    Keeps at most `max_open` shards open (least recently used are closed), of them at most
    `pins_needed(manifest)` remote ones: each is pinned in the node's cache, whose limit holds
    only when every reader pins few. One reader per process: DataLoader workers each build
    their own after forking.

    Args:
        manifest: the dataset; its root may be a folder or a URL (s3://, gs://, https://).
        split: the split to read.
        max_open: most shards kept open (memory-mapped; remote ones also pinned in the cache,
            at most `min(max_open, pins_needed(manifest))` of them); None: `open_limit`, every
            local shard of the split up to `LOCAL_OPEN_LIMIT`, so a shuffle window spanning
            many shards does not re-open them batch after batch.
        cache: the node-local cache for a remote dataset; None means `ShardCache.default()`
            (`$FASTDATA_CACHE_DIR` or ~/.cache/fastdata/shards, 50 GB). Unused for local shards.
        verify_samples: also hash every sample read and compare it with the digest written at
            shard time (the shard's `sums` file; shards without one are read unchecked, with a
            warning).
    """

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        max_open: int | None = None,
        cache: ShardCache | None = None,
        verify_samples: bool = False,
    ) -> None:
        self.manifest = manifest
        self.shards: list[ShardInfo] = manifest.split(split).shards
        if max_open is None:
            max_open = open_limit(manifest, split)
        self.max_open = max_open
        self.max_pinned = max(1, min(max_open, pins_needed(manifest)))
        self.cache = cache
        self.verify_samples = verify_samples
        self._remote = "://" in manifest.root
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._failed: dict[int, str] = {}  # remote shards that failed to download: the reason
        self._given: dict[int, bytes | mmap.mmap] = {}  # `use_bytes`: read from these instead
        self._starts = np.cumsum([0] + [s.num_samples for s in self.shards]).tolist()

    def key(self, shard: int, index: int) -> str:
        return self._get(shard)[0].keys[index]

    def use_bytes(self, shard: int, data: bytes | mmap.mmap) -> None:
        """Read shard `shard` from `data`, its whole tar already at hand (`fastdata verify`
        fetched a remote shard to hash it), instead of fetching it again or going through the
        cache; its index is loaded (and checked) as for any shard. Takes effect the next time the
        shard is opened; the reader closes `data` with the shard."""
        if shard in self._open:
            _, old, old_pin, _, _ = self._open.pop(shard)
            _close(old, old_pin)
        self._given[shard] = data

    def position(self, shard: int, index: int) -> int:
        """The sample's position in its split (shards in manifest order): the sample id of a
        foreign sample, whose key carries none (`fastdata.format.schema.label_and_id`)."""
        return int(self._starts[shard]) + index

    def sample(
        self, shard: int, index: int, exts: tuple[str, ...] | None = None
    ) -> dict[str, memoryview]:
        """The components of one sample (all of them, or those in `exts`), as zero-copy views.

        Raises:
            ShardReadError: a component is missing, lies past the end of a truncated shard, does
                not match its tar header, a label is outside the class list, or (verify_samples)
                the sample's bytes differ from their digest.
        """
        shard_index, data, _, sums, suspects = self._get(shard)
        key = shard_index.keys[index]
        entry = shard_index.components[index]
        wanted = exts if exts is not None else tuple(entry)
        view = memoryview(data)
        out: dict[str, memoryview] = {}
        name = self.shards[shard].name
        for ext in wanted:
            if ext not in entry:
                raise ShardReadError(
                    name, key, f"sample has no '{ext}' component (has {sorted(entry)})"
                )
            offset, size = entry[ext]
            if offset + size > len(data):
                raise ShardReadError(
                    name,
                    key,
                    f"shard is truncated ({len(data)} bytes; '{ext}' needs bytes up to {offset + size})",
                )
            if suspects is None or index in suspects:
                problem = check_header(data, offset, size, f"{key}.{ext}")
                if problem is not None:
                    raise ShardReadError(name, key, problem)
            out[ext] = view[offset : offset + size]
        if suspects is None or index in suspects:
            self._check_label(shard, key, out)
        if sums is not None:
            every = out if exts is None else {e: view[o : o + n] for e, (o, n) in entry.items()}
            problem = sums.check(index, every)
            if problem is not None:
                raise ShardReadError(name, key, problem)
        return out

    def uniform(self, shard: int) -> tuple[ShardIndex, bytes | mmap.mmap, set[int]] | None:
        """(index, bytes, suspect samples) of a shard whose samples can be read by array
        operations: its index lists the same components on every line and every header and
        label was checked at once when it was opened (`scan_shard`); no per-sample digests are
        to be checked. None: read it sample by sample (`sample`), which names any problem.

        Raises:
            ShardReadError: the shard cannot be opened (as `sample` raises).
        """
        index, data, _, sums, suspects = self._get(shard)
        if index.layout is None or suspects is None or sums is not None:
            return None
        return index, data, suspects

    def _check_label(self, shard: int, key: str, parts: dict[str, memoryview]) -> None:
        """Refuse a stored label outside the shard's dataset's classes (names shard and key)."""
        info = self.shards[shard]
        classes = len(info.label_map) if info.label_map is not None else self.manifest.num_classes
        problem = label_problem(parts, classes)
        if problem is not None:
            raise ShardReadError(info.name, key, problem)

    def prefetch(self, shards: Sequence[int], ahead: int = 2) -> None:
        """Have the remote cache download shards ahead of the reads (`ShardCache.prefetch`).

        Args:
            shards: shard numbers in the order this process will first read them (repeats
                are dropped); local shards are left out, so a local dataset does nothing.
            ahead: shards downloaded ahead of the one being read.
        """
        infos = [self.shards[n] for n in dict.fromkeys(shards)]
        remote = [info for info in infos if "://" in self.manifest.shard_url(info)]
        if not remote:
            return
        if self.cache is None:
            from fastdata.remote import ShardCache

            self.cache = ShardCache.default()
        self.cache.prefetch(self.manifest, remote, ahead)

    def close(self) -> None:
        """Close every shard; a remote dataset's cache is then trimmed back within its limit
        (reads that found it full of pins went over it)."""
        pinned = any(pin is not None for _, _, pin, _, _ in self._open.values())
        for _, data, pin, _, _ in self._open.values():
            _close(data, pin)
        self._open.clear()
        for data in self._given.values():
            _close(data)
        self._given.clear()
        if pinned and self.cache is not None:
            try:
                self.cache.trim()
            except RuntimeError:  # LockTimeout: the next maker of room evicts instead
                pass

    def _get(self, shard: int) -> _OpenShard:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        info = self.shards[shard]
        given = self._given.pop(shard, None)
        # Per shard: a mix (`fastdata.read.mix`) may hold local and remote datasets.
        remote = given is None and "://" in self.manifest.shard_url(info)
        if remote:
            self._unpin_for(1)
        pin = self._acquire(shard, info) if remote else None
        data: bytes | mmap.mmap = b""
        try:
            tar = str(pin.tar) if pin else self.manifest.shard_url(info)
            data = given if given is not None else _open_bytes(tar, info.name)
            index_path = self.manifest.index_url(info)
            if pin is not None and "://" in index_path:
                index_path = pin.index  # else a local index of remote tars (`fastdata index`)
            index = load_index(str(index_path) if index_path else None, info, data)
            check_index_count(index, info)
            sums = self._sums(info, index) if self.verify_samples else None
            suspects = self._suspects(info, data, index)
        except BaseException:
            _close(data, pin)
            raise
        self._open[shard] = (index, data, pin, sums, suspects)
        while len(self._open) > self.max_open:
            _, (_, old, old_pin, _, _) = self._open.popitem(last=False)
            _close(old, old_pin)
        return self._open[shard]

    def _unpin_for(self, more: int) -> None:
        """Close least recently used remote shards until `more` pins stay within `max_pinned`:
        before pinning the next, so this reader never holds more than the cache was sized for."""
        pinned = [n for n, entry in self._open.items() if entry[2] is not None]
        for number in pinned[: max(0, len(pinned) + more - self.max_pinned)]:
            _, old, old_pin, _, _ = self._open.pop(number)
            _close(old, old_pin)

    def _suspects(
        self, info: ShardInfo, data: bytes | mmap.mmap, index: ShardIndex
    ) -> set[int] | None:
        """Samples whose headers or label `scan_shard` found wrong (each is checked again, and
        named, when read); None: check every sample as it is read."""
        if index.layout is None:
            return None
        classes = len(info.label_map) if info.label_map is not None else self.manifest.num_classes
        bad = scan_shard(data, index.keys, index.layout, classes)
        return None if bad is None else set(np.flatnonzero(bad).tolist())

    def _sums(self, info: ShardInfo, index: ShardIndex) -> SampleSums | None:
        """The shard's per-sample digests (verify_samples); None, with a warning, without any."""
        options = self.cache.storage_options if self.cache is not None else None
        try:
            return load_sums(self.manifest, info, index.keys, options, self.cache)
        except (OSError, IntegrityError) as exc:
            raise ShardReadError(info.name, None, f"per-sample digests unreadable: {exc}") from exc

    def _acquire(self, shard: int, info: ShardInfo) -> CachedShard:
        """The remote shard's cached files, pinned while this reader has the shard open.

        A shard that fails to download is failed for this reader's life (one epoch of one
        worker): its other samples raise at once, without downloading it again.

        Raises:
            ShardReadError: with `shard_failed` set; the message names the URL and the cause.
        """
        if shard in self._failed:
            raise ShardReadError(info.name, None, self._failed[shard], shard_failed=True)
        if self.cache is None:
            from fastdata.remote import ShardCache

            self.cache = ShardCache.default()
        try:
            return self.cache.acquire(self.manifest, info)
        except RuntimeError as exc:  # RemoteError: names the URL and what to do
            self._failed[shard] = (
                f"{exc} (all {info.num_samples} samples of the shard fail this epoch; it is not "
                "downloaded again before the next)"
            )
            raise ShardReadError(info.name, None, self._failed[shard], shard_failed=True) from exc


def read_sample(
    manifest: Manifest, split: str, shard: int, index: int, cache: ShardCache | None = None
) -> dict[str, bytes]:
    """One sample's components as bytes (convenience; loops should keep a `ShardReader`)."""
    reader = ShardReader(manifest, split, max_open=1, cache=cache)
    try:
        return {ext: bytes(view) for ext, view in reader.sample(shard, index).items()}
    finally:
        reader.close()


_OpenShard = tuple[
    ShardIndex, "bytes | mmap.mmap", "CachedShard | None", SampleSums | None, set[int] | None
]


def _close(data: bytes | mmap.mmap, pin: CachedShard | None = None) -> None:
    if isinstance(data, mmap.mmap):
        try:
            data.close()
        except BufferError:
            pass  # a sample view is still alive; the map closes when the last view goes
    if pin is not None:
        # Unpinned, the cache may evict the file; a map still alive keeps its pages readable
        # (on POSIX, deleting a mapped file frees its space only when the map goes).
        pin.release()


def _open_bytes(url: str, name: str) -> bytes | mmap.mmap:
    """A local shard memory-mapped, or a remote object fetched whole (for `fastdata verify`;
    readers go through the cache instead)."""
    if "://" in url:
        from fastdata.remote.fs import read_bytes

        try:
            return read_bytes(url)
        except Exception as exc:
            raise ShardReadError(name, None, f"cannot fetch {url} ({exc})") from exc
    try:
        with os.fdopen(open_regular(url), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError as exc:
        raise ShardReadError(name, None, f"shard file {url} is missing") from exc
    except IntegrityError as exc:
        raise ShardReadError(name, None, str(exc)) from exc
