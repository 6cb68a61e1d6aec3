"""Where `fastdata index` finds other tools' tars: a folder, a URL pattern, a list of URLs.

`locate` turns the SOURCE of `fastdata index` into a data root (an absolute folder or a URL prefix
ending in "/") and each tar's name relative to it; `open_tar` opens one tar as a stream (a local
regular file, or an HTTP body streamed through fsspec with the connect and read timeouts of
`fastdata.remote.config.Timeouts`).

A gzip-compressed tar (`.tar.gz`, `.tgz`, as webdataset reads them: its own test shard is one) has
no random access: a member's offset in the tar is no offset in the file, so no index can point
into it. `fastdata index` writes an uncompressed copy into OUT (`inflate_to`) rather than reading
such shards in stream order: every backend, the epoch plan's shuffle across shards and rows,
resuming mid-epoch and `verify` need a sample at a known offset, and stream order would give all
of that up for a split. The copy costs disk (the tar's uncompressed size, once) and is written
under a temporary name, checked against the sha256 measured while it was scanned, and renamed
into place with the index files: never half-written.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fastdata.format.integrity import open_regular

__all__ = [
    "IndexingError",
    "Located",
    "expand_braces",
    "inflate_to",
    "is_compressed",
    "locate",
    "open_tar",
    "stored_name",
]

#: Shard names `fastdata index` reads: plain tars, and gzip-compressed ones (inflated into OUT).
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_COMPRESSED = (".tar.gz", ".tgz")
#: Free bytes an inflated copy leaves on OUT's disk (it stops with an error before less).
_MIN_FREE = 256 << 20

_BRACE = re.compile(r"\{([^{}]*)\}")
_MAX_EXPANSION = 1_000_000


class IndexingError(ValueError):
    """`fastdata index` cannot index the given shards (the message says what to do)."""


def expand_braces(pattern: str) -> list[str]:
    """webdataset's brace notation: `a-{000..002}.tar` -> a-000.tar, a-001.tar, a-002.tar
    (zero-padded to the width of the first bound); `{x,y}` lists; several braces multiply.

    Raises:
        IndexingError: a malformed range or an expansion of more than a million names.
    """
    total = 1
    for body in _BRACE.findall(pattern):  # every brace's choices multiply: bound the product
        if ".." in body:
            first, _, last = body.partition("..")
            count = int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 1
        else:
            count = body.count(",") + 1
        total *= max(count, 1)
        if total > _MAX_EXPANSION:
            raise IndexingError(f"{pattern!r} expands to more than {_MAX_EXPANSION} names")
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    if ".." in body:
        first, _, last = body.partition("..")
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise IndexingError(f"{pattern!r}: {{{body}}} is not a range N..M with N <= M")
        width = len(first)
        choices = [f"{i:0{width}d}" for i in range(int(first), int(last) + 1)]
    else:
        choices = body.split(",")
    if len(choices) > _MAX_EXPANSION:
        raise IndexingError(f"{pattern!r} expands to more than {_MAX_EXPANSION} names")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for c in choices for name in expand_braces(head + c + tail)]


def is_compressed(name: str) -> bool:
    """Whether shard `name` is a gzip-compressed tar (`.tar.gz`, `.tgz`)."""
    return name.lower().endswith(_COMPRESSED)


def stored_name(name: str) -> str:
    """The name of shard `name`'s uncompressed tar (`a/x.tgz` -> `a/x.tar`; a `.tar` is kept)."""
    lower = name.lower()
    for suffix in _COMPRESSED:
        if lower.endswith(suffix):
            return name[: -len(suffix)] + ".tar"
    return name


def _is_shard(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES)


class _Inflating(io.RawIOBase):
    """A gzip stream read decompressed, every byte also written to `sink` (the copy in OUT)."""

    def __init__(self, raw: BinaryIO, sink: BinaryIO, where: str, path: str) -> None:
        self.gzip = gzip.GzipFile(fileobj=raw, mode="rb")
        self.sink, self.where, self.path = sink, where, path
        self.written = 0
        self.checked = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        try:
            data = self.gzip.read(len(buffer))
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # not network errors: retried
            raise IndexingError(
                f"{self.where}: not a readable gzip-compressed tar ({type(exc).__name__}: {exc}); "
                "download or write it again"
            ) from exc
        n = len(data)
        buffer[:n] = data
        try:
            self.sink.write(data)
        except OSError as exc:
            raise IndexingError(
                f"{self.where}: writing its uncompressed copy {self.path} failed ({exc}); free "
                "space on OUT's disk or choose another --out (nothing was kept)"
            ) from exc
        self.written += n
        if self.written - self.checked > 64 << 20:  # a tar that inflates without end: stop
            self.checked = self.written
            free = os.statvfs(os.path.dirname(self.path))
            if free.f_bavail * free.f_frsize < _MIN_FREE:
                raise IndexingError(
                    f"{self.where}: its uncompressed copy reached {self.written} bytes and OUT's "
                    f"disk has less than {_MIN_FREE >> 20} MiB left; free space or choose "
                    "another --out (nothing was kept)"
                )
        return n


def inflate_to(stream: BinaryIO, path: str, where: str, scan):  # noqa: ANN001, ANN201
    """`scan(reader)` of a gzip-compressed tar's uncompressed bytes, written to `path` meanwhile.

    The copy is synced, read back and compared with the sha256 the scan measured before the
    result is returned: a copy that differs from what was indexed is never renamed into place.
    On any failure `path` is removed.

    Raises:
        IndexingError: not gzip data, a write that failed, a copy that differs (names the tar).
    """
    try:
        with open(path, "wb") as sink:
            result = scan(_Inflating(stream, sink, where, path))
            sink.flush()
            os.fsync(sink.fileno())
        digest = hashlib.sha256()
        with open(path, "rb") as copy:
            while chunk := copy.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != result.sha256 or os.path.getsize(path) != result.bytes:
            raise IndexingError(
                f"{where}: its uncompressed copy {path} differs from what was indexed (a disk "
                "or memory fault); run `fastdata index` again"
            )
        return result
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise


@dataclass(frozen=True)
class Located:
    """The tars of a SOURCE.

    Args:
        data_root: an absolute folder, or a URL prefix ending in "/".
        names: each tar's name relative to `data_root`, in order.
        local_dir: the folder, for a local source (None for URLs).
    """

    data_root: str
    names: list[str]
    local_dir: str | None


def locate(source: str, options: Any) -> Located:
    """The tars of SOURCE: a folder (searched recursively, hidden folders left out), a URL in
    brace notation, a URL of a folder that lists its objects, or a local list file of URLs.

    Args:
        source: as above.
        options: `fastdata.write.index.IndexOptions` (storage options and timeouts for URLs).

    Raises:
        IndexingError: no tars, URLs of several hosts, a URL listed twice, a list file with
            something that is not a URL.
    """
    if "://" in source:
        urls = expand_braces(source)
        if len(urls) == 1 and not _is_shard(urls[0]):
            urls = _list_remote(urls[0], options)
        return _common_root(urls, source)
    path = Path(source)
    if path.is_dir():
        root = path.resolve()
        names = sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if _is_shard(p.name)
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not names:
            raise IndexingError(
                f"{source}: no .tar (or .tar.gz, .tgz) files in this folder or below it"
            )
        return Located(str(root), names, str(root))
    if path.is_file():
        lines = [ln.strip() for ln in path.read_text().splitlines()]
        urls = [
            u for line in lines if line and not line.startswith("#") for u in expand_braces(line)
        ]
        if not urls or not all("://" in u for u in urls):
            raise IndexingError(
                f"{source}: a list file must hold one shard URL a line (http(s)://, s3://, "
                "gs://); for local tars pass their folder"
            )
        return _common_root(urls, source)
    raise IndexingError(f"{source}: no such folder, list file or URL")


def _list_remote(url: str, options: Any) -> list[str]:
    from fastdata.remote.fs import filesystem

    fs, path = filesystem(url, options.storage_options, options.timeouts)  # type: ignore[arg-type]
    found = sorted(p for p in fs.glob(path.rstrip("/") + "/*") if _is_shard(p.rstrip("/")))
    if not found:
        raise IndexingError(
            f"{url}: no .tar (or .tar.gz, .tgz) objects listed there; name the shards with a brace pattern "
            "(https://host/path/shards-{000000..000009}.tar) or a list file of URLs"
        )
    prefix = url.rstrip("/") + "/"
    return [prefix + p.rstrip("/").rsplit("/", 1)[-1] for p in found]


def _common_root(urls: list[str], source: str) -> Located:
    """The longest common folder URL of `urls`, and each URL's name relative to it."""
    heads = [u.rsplit("/", 1)[0] + "/" for u in urls]
    root = os.path.commonprefix(heads)
    root = root[: root.rfind("/") + 1]
    scheme_end = root.find("://") + 3
    if scheme_end < 3 or "/" not in root[scheme_end:]:
        raise IndexingError(
            f"{source}: the shard URLs share no scheme and host (e.g. http://host/path/); "
            "index each store on its own"
        )
    names = [u[len(root) :] for u in urls]
    if len(set(names)) != len(names):
        raise IndexingError(f"{source}: a shard URL is listed twice")
    return Located(root, names, None)


def open_tar(located: Located, name: str, options: Any, stack: ExitStack) -> BinaryIO:
    """Tar `name` of `located` opened for one sequential read, closed by `stack`: a local
    regular file (a FIFO is refused), or a remote object streamed (HTTP: no range requests)."""
    if located.local_dir is not None:
        return stack.enter_context(
            os.fdopen(open_regular(os.path.join(located.local_dir, name)), "rb")
        )
    from fastdata.remote.fs import filesystem

    url = located.data_root + name
    fs, path = filesystem(url, options.storage_options, options.timeouts)  # type: ignore[arg-type]
    kwargs = {"block_size": 0} if url.split("://", 1)[0].lower() in ("http", "https") else {}
    return stack.enter_context(fs.open(path, "rb", **kwargs))
