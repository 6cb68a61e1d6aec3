"""Checks a reader can afford on every read, and the opt-in per-sample digests.

A manifest and its files may come from anyone (a shared folder, a web server), so the reader
trusts nothing it has not checked:

- files are opened only as regular files (`open_regular`: a FIFO never blocks a reader);
- an index file is hashed when it is loaded and compared with the manifest's `index_sha256`
  (`read_index_text`: a few KB a shard, once per shard opened);
- every component read is matched with its tar header, the 512 bytes before its data: member
  name = sample key + "." + component, size = the index's size, and every `lid` label with the
  class list. When a shard is opened, `scan_shard` compares all its headers and labels in a few
  array operations (~2 ms for 5,000 samples) and marks the samples that do not match; reading a
  marked sample (or any sample of an index `scan_shard` cannot vectorize) runs the per-sample
  check (`check_header`, ~1 us a component), whose error names the sample;
- with `verify_samples=True`, each sample's components are hashed (BLAKE2b-128) and compared with
  the shard's digest list, the `sums` file written beside the shard (`SampleSums`). Shards written
  without one (other tools, older fastdata) still load; the check is then skipped for them with
  one warning.

The `sums` file is text: a header line ``fastdata-sums v1 blake2b-128 N``, then ``KEY HEX`` for
each of the N samples, in the shard's order.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from fastdata.format.manifest import Manifest, ShardInfo
from fastdata.format.schema import SUMS_HEADER, sample_digest

__all__ = [
    "IntegrityError",
    "ShardReadError",
    "SampleSums",
    "check_header",
    "check_indexes",
    "label_problem",
    "scan_shard",
    "uniform_layout",
    "load_sums",
    "open_regular",
    "read_checked",
]


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


log = logging.getLogger("fastdata")

_BLOCK = 512


class IntegrityError(ValueError):
    """A file or sample does not match what the manifest or the tar header says."""


def open_regular(path: str) -> int:
    """A read-only descriptor of `path`, refusing anything but a regular file.

    Opened non-blocking, so a FIFO in place of a shard or index never blocks the reader.

    Raises:
        FileNotFoundError: no such file.
        IntegrityError: the path is a FIFO, device, socket or folder.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise IntegrityError(f"{path} is not a regular file (a FIFO, device or folder)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checked(path: str, sha256: str | None, what: str) -> bytes:
    """The bytes of a local file, checked against `sha256` when given.

    Raises:
        FileNotFoundError: no such file.
        IntegrityError: not a regular file, or its digest differs (names `what` and the file).
    """
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    check_digest(data, sha256, what, path)
    return data


def check_digest(data: bytes, sha256: str | None, what: str, path: str) -> None:
    """Raise IntegrityError unless `data` hashes to `sha256` (None: nothing to check)."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise IntegrityError(
            f"{what} {path} differs from the manifest's sha256 (changed, truncated or replaced "
            "after sharding)"
        )


def check_header(data: bytes | memoryview, offset: int, size: int, member: str) -> str | None:
    """None when the tar header before `offset` names `member` with `size` bytes; else why not.

    The header is the 512 bytes before a member's data. The fast path compares the name and the
    size field as this project's writer (and Python's tarfile, GNU tar) write them; other
    spellings of the same values (ustar prefix, space-terminated octal) are parsed.
    """
    if offset < _BLOCK or offset % _BLOCK:
        return f"index offset {offset} of {member!r} is not just after a tar header"
    start = offset - _BLOCK
    name = member.encode()
    if len(name) < 100:
        name_ok = data[start : start + len(name) + 1] == name + b"\0"
    else:
        name_ok = data[start : start + 100] == name[:100]
    if name_ok and data[start + 124 : start + 136] == b"%011o\x00" % size:
        return None
    header = bytes(data[start:offset])
    found = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar" and header[345]:
        found = header[345:500].split(b"\0", 1)[0] + b"/" + found
    try:
        found_size = int(header[124:136].strip(b"\0 ") or b"0", 8)
    except ValueError:
        found_size = -1
    # A long name (GNU `././@LongLink` or PAX `path` before this header) leaves its first 100
    # bytes here; a PAX header's non-ASCII name leaves '?' for each such character.
    spelled = member.encode("ascii", "replace")
    if found not in (name, name[:100], spelled, spelled[:100]):
        return (
            f"tar header names {found.decode(errors='replace')!r} where the index places "
            f"{member!r} (index and tar disagree: a wrong or shifted index)"
        )
    if found_size != size:
        return f"tar header gives {member!r} {found_size} bytes, the index {size}"
    return None


def uniform_layout(text: str, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """ext -> (offsets, sizes) of a DALI index whose lines all list the same components.

    None when the index is not like that (`fastdata.read.shard_index.parse_index` then reads it line
    by line and says what is wrong).
    """
    return layout_of_tokens(text.split(), n)


def layout_of_tokens(tokens: list[str], n: int) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """`uniform_layout` of an index already split into tokens."""
    if n < 1 or len(tokens) < 2 or not tokens[0].startswith("v1.") or tokens[1] != str(n):
        return None
    body = tokens[2:]
    fields = len(body) // n
    if len(body) % n or fields % 4 or not fields:
        return None
    exts = body[0:fields:4]
    if len(set(exts)) != len(exts) or body[0::4] != exts * n:
        return None
    try:  # int() of each number: ~4 ms for 10,000 lines (numpy's string conversions are slower)
        offsets = np.array(list(map(int, body[1::4])), dtype=np.int64).reshape(n, -1)
        sizes = np.array(list(map(int, body[2::4])), dtype=np.int64).reshape(n, -1)
    except ValueError:
        return None
    return {e: (offsets[:, k], sizes[:, k]) for k, e in enumerate(exts)}


_OCTAL = 8 ** np.arange(10, -1, -1, dtype=np.int64)


def _window(array: np.ndarray, width: int) -> np.ndarray:
    """A (len - width + 1, width) view: row i is array[i : i + width] (no copy)."""
    return as_strided(array, (len(array) - width + 1, width), (1, 1), writeable=False)


def _expected_names(keys: list[str]):
    """A function (array, header starts, ext) -> bool (n,): True where a header's name field is
    not key + "." + ext. None when a key is not ASCII."""
    try:
        joined = "".join(keys).encode("ascii")
    except UnicodeEncodeError:
        return None
    width = len(keys[0]) if keys else 0
    if all(len(k) == width for k in keys):
        # Keys of one length (`schema.sample_key`): compare bytes, no string arrays.
        key_bytes = np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), width)

        def differs(array: np.ndarray, starts: np.ndarray, ext: str) -> np.ndarray:
            tail = np.frombuffer(f".{ext}".encode() + b"\0", dtype=np.uint8)
            span = width + len(tail)
            if span > 100:
                return np.ones(len(keys), dtype=bool)
            wanted = np.empty((len(keys), span), dtype=np.uint8)
            wanted[:, :width], wanted[:, width:] = key_bytes, tail
            got = _window(array, span)[starts]  # a copy: contiguous rows
            return (got.view(f"V{span}") != wanted.view(f"V{span}")).ravel()

        return differs
    key_strings = np.array(keys, dtype="S100")

    def differs_varied(array: np.ndarray, starts: np.ndarray, ext: str) -> np.ndarray:
        wanted = np.strings.add(key_strings, f".{ext}".encode())
        return _window(array, 100)[starts].view("S100").ravel() != wanted

    return differs_varied


def scan_shard(
    data: bytes | memoryview | mmap.mmap | np.ndarray,
    keys: list[str],
    layout: dict[str, tuple[np.ndarray, np.ndarray]],
    classes: int,
) -> np.ndarray | None:
    """Which samples of a shard fail the every-read checks, all compared at once (~1 us a
    sample).

    Args:
        data: the tar's bytes.
        keys: each sample's key, from the index.
        layout: ext -> (offsets, sizes) from the index (`uniform_layout`).
        classes: labels must lie in 0..classes-1.

    Returns:
        bool (n,), True for a sample whose component headers (member name = key + "." +
        component, size field, offset just after a header) or `lid` label do not match; None
        when the index holds no `lid` or a key is not ASCII: the caller then checks each sample
        as it reads it.
    """
    if "lid" not in layout:
        return None
    n = len(keys)
    array = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if len(array) < _BLOCK:
        return np.ones(n, dtype=bool)
    names = _expected_names(keys)
    if names is None:
        return None
    size_fields = _window(array[124:], 12)  # row i: the size field of a header at i
    bad = np.zeros(n, dtype=bool)
    for ext, (offsets, sizes) in layout.items():
        placed = (offsets >= _BLOCK) & (offsets % _BLOCK == 0) & (offsets + sizes <= len(array))
        bad |= ~placed
        starts = np.where(placed, offsets, _BLOCK) - _BLOCK
        bad |= names(array, starts, ext)
        same = (sizes == sizes[0]).all()
        wanted = np.zeros((1 if same else n, 12), dtype=np.uint8)  # 11 octal digits, then NUL
        wanted[:, :11] = (sizes[:1] if same else sizes)[:, None] // _OCTAL % 8 + 48
        bad |= (size_fields[starts].view("V12") != wanted.view("V12")).ravel()
    offsets, sizes = layout["lid"]
    usable = ~bad & (sizes == 16)
    labels = _window(array, 8)[np.where(usable, offsets, 0)].view("<i8").ravel()
    bad |= (sizes != 16) | (labels < 0) | (labels >= classes)
    return bad


def label_problem(parts: Mapping[str, bytes | memoryview], classes: int) -> str | None:
    """None when the labels a sample stores (`lid`'s first int64, `cls`'s decimal) lie in
    0..classes-1; else what is wrong (an unreadable `cls` is left to `schema.label_and_id`)."""
    found = []
    if "lid" in parts and len(parts["lid"]) >= 8:
        found.append(("lid", int.from_bytes(parts["lid"][:8], "little", signed=True)))
    if "cls" in parts:
        with contextlib.suppress(ValueError):
            found.append(("cls", int(bytes(parts["cls"]))))
    for ext, label in found:
        if not 0 <= label < classes:
            return (
                f"'{ext}' label {label} is outside the manifest's {classes} classes "
                "(a corrupt or tampered sample)"
            )
    return None


class SampleSums:
    """A shard's per-sample digests, parsed and checked against its index's keys."""

    def __init__(self, text: str, keys: list[str], where: str) -> None:
        lines = text.splitlines()
        head = lines[0].rsplit(" ", 1) if lines else []
        if len(head) != 2 or head[0] != SUMS_HEADER or head[1] != str(len(lines) - 1):
            raise IntegrityError(f"{where}: not a {SUMS_HEADER!r} file")
        pairs = [line.split(" ") for line in lines[1:]]
        if [p[0] for p in pairs] != keys or any(len(p) != 2 for p in pairs):
            raise IntegrityError(f"{where}: its keys differ from the shard index's")
        self.digests = [p[1] for p in pairs]

    def check(self, index: int, parts: Mapping[str, bytes | memoryview]) -> str | None:
        """None when sample `index` hashes to its recorded digest; else why not."""
        if sample_digest(parts) != self.digests[index]:
            return "sample bytes differ from the digest written at shard time (verify_samples)"
        return None


def check_indexes(manifest: Manifest, split: str) -> None:
    """Check every local index file of a split against the manifest (for readers that hand the
    index files to another library, such as DALI, instead of loading them through
    `fastdata.read.shardio`).

    Raises:
        ShardReadError: an index file is not a regular file or differs from its sha256.
    """
    for info in manifest.split(split).shards:
        url = manifest.index_url(info)
        if "://" in url:
            continue  # remote shards are read from the cache, whose index the reader checks
        try:
            read_checked(url, info.index_sha256, "index file")
        except FileNotFoundError:
            continue  # DALI then scans the tar
        except (OSError, IntegrityError) as exc:
            raise ShardReadError(info.name, None, str(exc)) from exc


_WARNED_NO_SUMS: set[str] = set()


def load_sums(
    manifest: Manifest,
    info: ShardInfo,
    keys: list[str],
    storage_options: Mapping | None = None,
    cache: Any = None,
) -> SampleSums | None:
    """The shard's `sums` file (local or remote), checked against the manifest's digest; None,
    with one warning per dataset, for a shard written without one.

    A remote file is fetched with `cache`'s retry policy and timeouts (a `ShardCache`; None:
    the defaults), as the shard and its index are.

    Raises:
        OSError: the file cannot be read.
        IntegrityError: it differs from its sha256, or lists other keys than the index.
    """
    url = manifest.sums_url(info)
    if url is None:
        if manifest.root not in _WARNED_NO_SUMS:
            _WARNED_NO_SUMS.add(manifest.root)
            log.warning(
                "verify_samples: shard %s of %s has no per-sample digests (written by another "
                "tool or an older fastdata); such shards are read unchecked",
                info.name,
                manifest.root,
            )
        return None
    if "://" in url:
        from fastdata.remote.fs import read_bytes

        policy = {} if cache is None else {"retry": cache.retry, "timeouts": cache.timeouts}
        data = read_bytes(url, storage_options, **policy)
        check_digest(data, info.sums_sha256, "sums file", url)
    else:
        data = read_checked(url, info.sums_sha256, "sums file")
    return SampleSums(data.decode("utf-8", errors="replace"), keys, f"sums file {url}")
