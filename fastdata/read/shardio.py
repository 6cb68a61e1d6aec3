"""Reading samples out of shards by their index: random access without scanning tars.

The DALI index written beside each shard gives every component's byte offset and size, so a
sample is one slice of a memory-mapped file. Remote shards (s3://, gs://, https://) are read
the same way from a node-local `fastdata.remote.ShardCache`: downloaded once per node, checked
against the manifest's sha256, then memory-mapped like local shards.
"""

from __future__ import annotations

import mmap
import os
import tarfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastdata.manifest import Manifest, ShardInfo

if TYPE_CHECKING:  # fastdata.remote is imported only for remote datasets
    from fastdata.remote import CachedShard, ShardCache

__all__ = ["ShardIndex", "ShardReadError", "ShardReader", "parse_index", "read_sample"]


class ShardReadError(RuntimeError):
    """A shard or one of its samples cannot be read. The message names the shard and the key.

    Attributes:
        shard_failed: the whole shard is unreadable this epoch (a remote shard that could not be
            downloaded): every one of its samples raises this, without another download.
    """

    def __init__(
        self,
        shard: str,
        key: str | None = None,
        reason: str | None = None,
        shard_failed: bool = False,
    ) -> None:
        self.shard_failed = shard_failed
        if reason is None:
            # Re-raised in the main process by a DataLoader worker, which passes one message
            # (that already names the shard and the key): keep the type, so callers can catch it.
            super().__init__(shard)
            self.shard, self.key, self.reason = None, None, shard
            return
        where = f"{shard}, sample {key!r}" if key else shard
        super().__init__(
            f"{where}: {reason}. Run `fastdata verify` on the shard folder to list every bad "
            "sample; re-shard, or pass on_error='skip' to skip bad samples"
        )
        self.shard = shard
        self.key = key
        self.reason = reason

    def __reduce__(self):  # pickling (e.g. multiprocessing) keeps every field
        return (ShardReadError, (self.shard, self.key, self.reason, self.shard_failed))


@dataclass(frozen=True)
class ShardIndex:
    """A parsed index: the key of each sample and its components' (offset, size) by extension."""

    keys: list[str]
    components: list[dict[str, tuple[int, int]]]

    def __len__(self) -> int:
        return len(self.keys)


def parse_index(text: str, shard: str) -> ShardIndex:
    """Parse DALI's `v1.2` webdataset index (see fastdata.write.tarshard)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("v1."):
        raise ShardReadError(shard, None, "index file has no 'v1.x N' header")
    keys: list[str] = []
    components: list[dict[str, tuple[int, int]]] = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields or len(fields) % 4:
            raise ShardReadError(shard, None, f"index line {number} is malformed: {line[:80]!r}")
        entry = {}
        for i in range(0, len(fields), 4):
            ext, offset, size, name = fields[i : i + 4]
            entry[ext] = (int(offset), int(size))
        keys.append(name.split(".", 1)[0])
        components.append(entry)
    declared = int(lines[0].split()[1])
    if declared != len(keys):
        raise ShardReadError(
            shard, None, f"index declares {declared} samples but lists {len(keys)}"
        )
    return ShardIndex(keys, components)


def index_from_tar(data: bytes | mmap.mmap, shard: str) -> ShardIndex:
    """Build the index by scanning the tar (used only when the .idx file is missing)."""
    import io

    keys: list[str] = []
    components: list[dict[str, tuple[int, int]]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                key, _, ext = member.name.partition(".")
                if not keys or keys[-1] != key:
                    keys.append(key)
                    components.append({})
                components[-1][ext] = (member.offset_data, member.size)
    except tarfile.TarError as exc:
        raise ShardReadError(shard, keys[-1] if keys else None, f"corrupt tar ({exc})") from exc
    return ShardIndex(keys, components)


class ShardReader:
    """Open shards of one manifest and return sample components by (shard number, index).

    Keeps at most `max_open` shards open (least recently used are closed). One reader per
    process: DataLoader workers each build their own after forking.

    Args:
        manifest: the dataset; its root may be a folder or a URL (s3://, gs://, https://).
        split: the split to read.
        max_open: most shards kept open (memory-mapped; for a remote dataset, also pinned in
            the cache, so the cache must hold at least max_open shards per reader).
        cache: the node-local cache for a remote dataset; None means `ShardCache.default()`
            (`$FASTDATA_CACHE_DIR` or ~/.cache/fastdata/shards, 50 GB). Unused for local shards.
    """

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        max_open: int = 8,
        cache: ShardCache | None = None,
    ) -> None:
        self.manifest = manifest
        self.shards: list[ShardInfo] = manifest.split(split).shards
        self.max_open = max_open
        self.cache = cache
        self._remote = "://" in manifest.root
        self._open: OrderedDict[int, tuple[ShardIndex, bytes | mmap.mmap, CachedShard | None]]
        self._open = OrderedDict()
        self._failed: dict[int, str] = {}  # remote shards that failed to download: the reason

    def key(self, shard: int, index: int) -> str:
        return self._get(shard)[0].keys[index]

    def sample(
        self, shard: int, index: int, exts: tuple[str, ...] | None = None
    ) -> dict[str, memoryview]:
        """The components of one sample (all of them, or those in `exts`), as zero-copy views.

        Raises:
            ShardReadError: a component is missing or lies past the end of a truncated shard.
        """
        shard_index, data, _ = self._get(shard)
        key = shard_index.keys[index]
        entry = shard_index.components[index]
        wanted = exts if exts is not None else tuple(entry)
        view = memoryview(data)
        out: dict[str, memoryview] = {}
        for ext in wanted:
            if ext not in entry:
                raise ShardReadError(
                    self.shards[shard].name,
                    key,
                    f"sample has no '{ext}' component (has {sorted(entry)})",
                )
            offset, size = entry[ext]
            if offset + size > len(data):
                raise ShardReadError(
                    self.shards[shard].name,
                    key,
                    f"shard is truncated ({len(data)} bytes; '{ext}' needs bytes up to {offset + size})",
                )
            out[ext] = view[offset : offset + size]
        return out

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
        for _, data, pin in self._open.values():
            _close(data, pin)
        self._open.clear()

    def _get(self, shard: int) -> tuple[ShardIndex, bytes | mmap.mmap, CachedShard | None]:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        info = self.shards[shard]
        # Per shard: a mix (`fastdata.read.mix`) may hold local and remote datasets.
        pin = self._acquire(shard, info) if "://" in self.manifest.shard_url(info) else None
        try:
            tar = str(pin.tar) if pin else self.manifest.shard_url(info)
            data = _open_bytes(tar, info.name)
            index_path = self.manifest.index_url(info) if pin is None else pin.index
            index = _load_index(str(index_path) if index_path else None, info.name, data)
        except BaseException:
            if pin is not None:
                pin.release()
            raise
        if len(index) != info.num_samples:
            _close(data, pin)
            raise ShardReadError(
                info.name,
                None,
                f"index lists {len(index)} samples but the manifest says {info.num_samples}",
            )
        self._open[shard] = (index, data, pin)
        while len(self._open) > self.max_open:
            _, (_, old, old_pin) = self._open.popitem(last=False)
            _close(old, old_pin)
        return self._open[shard]

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
        with open(url, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError as exc:
        raise ShardReadError(name, None, f"shard file {url} is missing") from exc


def _load_index(path: str | None, name: str, data: bytes | mmap.mmap) -> ShardIndex:
    """Parse the local index file at `path`; scan the tar when there is none."""
    if path is None:
        return index_from_tar(data, name)
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return index_from_tar(data, name)
    return parse_index(text, name)
