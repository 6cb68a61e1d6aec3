"""Reading members of a tar archive without trusting its member names or types.

Nothing here extracts to disk: members are read as streams, in archive order, so a gzip archive is
decompressed once. Every member is still checked, because a member named `../x`, `/etc/x`, a link
or a device file has no place in a dataset archive and signals a crafted file; refusing the whole
archive is safer than guessing which members are harmless.
"""

from __future__ import annotations

import bz2
import io
import lzma
import posixpath
import tarfile
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import IO, Any

from fastdata.write.sources.base import BadSourceError, describe_path

__all__ = ["UnsafeArchiveError", "check_member", "iter_members"]


class UnsafeArchiveError(BadSourceError):
    """A tar member has an absolute path, a `..` component, or is a link or a special file."""


def check_member(archive: str | Path, member: tarfile.TarInfo) -> str:
    """Check that `member` is a plain file or folder with a relative name inside the archive.

    Args:
        archive: the archive, for the message.
        member: the member to check.

    Returns:
        The member's normalized name (no leading "./", no trailing "/").

    Raises:
        UnsafeArchiveError: naming the archive and the member.
    """
    raw = member.name
    problem = _name_problem(raw)
    if problem is None and (member.issym() or member.islnk()):
        problem = f"is a link (to {member.linkname!r})"
    elif problem is None and not (member.isfile() or member.isdir()):
        problem = "is a device file, fifo or other special file"
    if problem is not None:
        raise _refuse(Path(archive), raw, problem)
    name = posixpath.normpath(raw)
    return "" if name == "." else name


def _name_problem(raw: str) -> str | None:
    """Why `raw` cannot name a member inside the archive's folder; None: it can."""
    if raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        return "has an absolute path"
    if ".." in raw.replace("\\", "/").split("/"):
        return "has a '..' component"
    return None


def _refuse(archive: Path, raw: str, problem: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{describe_path(archive)}: member {raw!r} {problem}; refusing to read an "
        "archive that could write outside its folder. Use an archive from the dataset's "
        "official source."
    )


def iter_members(archive: str | Path, wanted: Collection[str]) -> Iterator[tuple[str, IO[bytes]]]:
    """Stream the `wanted` regular-file members of a (possibly compressed) tar archive.

    Every member is checked with `check_member`, wanted or not. Members are yielded in archive
    order; each file object is valid only until the next item is requested.

    Args:
        archive: a .tar, .tar.gz, .tar.bz2 or .tar.xz file (told apart by their first bytes).
        wanted: normalized member names to yield (e.g. "cifar-100-python/train").

    Yields:
        (normalized member name, binary file object).

    Raises:
        UnsafeArchiveError: a member is unsafe.
        BadSourceError: the file is not a readable tar archive.
    """
    try:
        with _open_stream(Path(archive)) as stream:
            for member in _headers(stream, Path(archive)):
                name = check_member(archive, member)
                body = _Member(stream, member.size if member.isfile() else 0, Path(archive))
                if member.isfile() and name in wanted:
                    yield name, io.BufferedReader(body, _READ_SIZE)
                body.skip_rest()
                _read_exactly(stream, -member.size % tarfile.BLOCKSIZE if member.isfile() else 0)
            # Past the end marker: the rest of a compressed stream is still inflated, so that its
            # checksum is verified and garbage after it is found, as `gzip` would.
            while stream.read(_READ_SIZE):
                pass
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError) as exc:
        raise _unreadable(Path(archive), exc) from exc


def _unreadable(archive: Path, exc: BaseException) -> BadSourceError:
    return BadSourceError(
        f"{describe_path(archive)}: not a readable tar archive ({exc}); the file may be "
        "truncated or corrupt: download it again."
    )


# ----------------------------------------------------------------------------- the stream
#
# `tarfile.open(mode="r|*")` read the CIFAR-100 archive in 1.75 s, of which 1.27 s is zlib: its
# stream layer joins and slices every member's bytes, and `extractfile` copies them again, each
# copy of the 150 MB train pickle a fresh allocation the kernel faults in. Here a member's bytes
# are inflated and copied once, into the buffer its reader asks for (1.40-1.47 s; `gzip.open` in
# `_Gunzip`'s place took 1.58-1.61 s against 1.38-1.45 s, alternated). Headers are
# still parsed by `tarfile.TarInfo.frombuf`; GNU long names and pax records are applied as
# tarfile applies them.

_READ_SIZE = 1 << 20
# The most one inflate call returns: bounds the memory a crafted archive (a few KB that inflate
# to gigabytes) takes at once. Real data inflates ~1.2x, far below it, so its input is never cut
# up (`unconsumed_tail` copies the rest of the input at every cut: 25% slower at 1 MiB).
_MAX_INFLATE = 16 * _READ_SIZE
_GZIP_MAGIC = b"\x1f\x8b"
_BZIP2_MAGIC = b"BZh"  # then a block size digit, then a block's or the stream end's magic
_BZIP2_NEXT = (b"1AY&SY", b"\x17rE8P\x90")
_XZ_MAGIC = b"\xfd7zXZ\x00"


def _open_stream(path: Path) -> IO[bytes]:
    """The archive's tar bytes: inflated on the way for gzip, bzip2 and xz files."""
    with open(path, "rb") as f:
        magic = f.read(10)
    if magic.startswith(_GZIP_MAGIC):
        return io.BufferedReader(_Gunzip(path), _READ_SIZE)
    if _is_bzip2(magic):
        return bz2.open(path, "rb")
    if magic.startswith(_XZ_MAGIC):
        return lzma.open(path, "rb")
    return open(path, "rb", buffering=_READ_SIZE)


class _Gunzip(io.RawIOBase):
    """The inflated bytes of a gzip file, as `gzip` reads it: one or more members (each checked
    by zlib against its CRC-32 and size), then at most zero padding."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)
        self._inflate = zlib.decompressobj(wbits=31)  # gzip framing
        self._input = b""
        self._pending = memoryview(b"")
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if not self._refill():
                return 0
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._pending))
        target[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _refill(self) -> bool:
        """Inflate the next input into `_pending`; False at the end of the file."""
        if not self._input:
            self._input = self._file.read(_READ_SIZE)
            if not self._input:
                if self._started and not self._inflate.eof:  # output zlib still holds
                    self._pending = memoryview(self._inflate.decompress(b"", _MAX_INFLATE))
                    if self._pending:
                        return True
                if not self._started or not self._inflate.eof:
                    raise EOFError(
                        "the gzip stream ended before its end-of-stream marker (truncated file)"
                    )
                return False
        if self._inflate.eof:  # a member ended: zero padding, or the next member
            self._input = self._input.lstrip(b"\x00")
            if not self._input:
                return True
            if not _GZIP_MAGIC.startswith(self._input[:2]):
                raise OSError(f"not a gzip member after the first one ({self._input[:2]!r})")
            self._inflate = zlib.decompressobj(wbits=31)
        try:
            self._pending = memoryview(self._inflate.decompress(self._input, _MAX_INFLATE))
        except zlib.error as exc:
            raise OSError(f"corrupt gzip data ({exc})") from exc
        self._started = True
        self._input = self._inflate.unconsumed_tail or self._inflate.unused_data
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


class _Member(io.RawIOBase):
    """`size` bytes of `stream`: one member's data. A damaged archive found while reading them
    raises `BadSourceError` naming `archive`."""

    def __init__(self, stream: IO[bytes], size: int, archive: Path) -> None:
        super().__init__()
        self._stream = stream
        self._archive = archive
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.left <= 0:
            return 0
        target = memoryview(buffer).cast("B")[: self.left]
        try:
            n = self._stream.readinto(target)  # type: ignore[attr-defined]
            if not n:
                raise EOFError(f"the archive ends inside a member ({self.left} bytes missing)")
        except (EOFError, OSError, lzma.LZMAError) as exc:
            raise _unreadable(self._archive, exc) from exc
        self.left -= n
        return n

    def skip_rest(self) -> None:
        """Read past what the consumer left of this member."""
        scratch = bytearray(min(self.left, _READ_SIZE))
        while self.left > 0:
            self.readinto(memoryview(scratch)[: min(self.left, len(scratch))])


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size) if size else b""
    if len(data) != size:
        raise EOFError(f"the archive ends inside a member ({size - len(data)} bytes missing)")
    return data


#: The most bytes an extended header (a GNU long name, pax records) may hold: real ones hold a
#: name or a few records; a crafted one claiming gigabytes would be read into memory.
_MAX_EXTENDED = 1 << 20
_EXTENDED = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


def _is_bzip2(magic: bytes) -> bool:
    """bzip2's full magic: a plain tar whose first member's name starts with "BZh" is a tar."""
    return (
        magic.startswith(_BZIP2_MAGIC)
        and magic[3:4] in b"123456789"
        and len(magic) == 10
        and magic[4:] in _BZIP2_NEXT
    )


def _headers(stream: IO[bytes], archive: Path) -> Iterator[tarfile.TarInfo]:
    """Each member's header, GNU long names and pax records applied, until the end marker.

    Every name an extended header gives is checked as it is read (`_name_problem`), whichever
    of them would name the member: an archive that any reader could see as `../x` is refused.
    One member may have one header of each kind; global pax records apply to every later member
    under its own records, as tarfile and GNU tar apply them.
    """
    extended: dict[bytes, bytes] = {}  # type -> the member's pending extended header
    global_pax: dict[str, str] = {}
    first = True
    while True:
        info = _next_header(stream, first)
        if info is None:
            return
        first = False
        if info.type in _EXTENDED:
            if info.size > _MAX_EXTENDED:
                raise tarfile.HeaderError(
                    f"an extended header of {info.size} bytes (at most {_MAX_EXTENDED})"
                )
            value = _read_exactly(stream, _padded(info.size))[: info.size]
            if info.type == tarfile.XGLTYPE:
                global_pax.update(_pax_records(value, archive))
                continue
            kind = tarfile.XHDTYPE if info.type == tarfile.SOLARIS_XHDTYPE else info.type
            if kind in extended:
                raise tarfile.HeaderError("two extended headers of one kind for one member")
            extended[kind] = value
            continue
        _apply_extended(info, extended, global_pax, archive)
        extended = {}
        yield info


def _next_header(stream: IO[bytes], first: bool) -> tarfile.TarInfo | None:
    """The next header's member; None at the end marker or end of file (EOFError mid-header)."""
    block = stream.read(tarfile.BLOCKSIZE)
    if len(block) < tarfile.BLOCKSIZE:
        if first:
            if not block:
                raise EOFError("empty file")
            raise EOFError(f"{len(block)} bytes, less than one tar header: not a tar archive")
        if not block:  # ended without an end marker: what tarfile accepts too
            return None
        raise EOFError("the archive ends inside a member header")
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.EOFHeaderError:
        return None
    except tarfile.EmptyHeaderError:  # a zero block: the end marker
        return None
    if info.size < 0:
        raise tarfile.HeaderError(f"member {info.name!r} has a negative size ({info.size})")
    return info


def _apply_extended(
    info: tarfile.TarInfo,
    extended: dict[bytes, bytes],
    global_pax: dict[str, str],
    archive: Path,
) -> None:
    """Give `info` the names and size its extended headers and the global pax records set."""
    pax = dict(global_pax)
    if tarfile.XHDTYPE in extended:
        pax.update(_pax_records(extended[tarfile.XHDTYPE], archive))
    for kind, field in ((tarfile.GNUTYPE_LONGNAME, "name"), (tarfile.GNUTYPE_LONGLINK, "linkname")):
        if kind in extended:
            text = extended[kind].split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            if (problem := _name_problem(text)) is not None:
                raise _refuse(archive, text, problem)
            setattr(info, field, text)
    if info.type == tarfile.GNUTYPE_SPARSE or _SPARSE in pax:
        raise tarfile.HeaderError(f"member {info.name!r} is a GNU sparse file")
    if "path" in pax:
        info.name = pax["path"]
    if "linkpath" in pax:
        info.linkname = pax["linkpath"]
    if "size" in pax:
        info.size = _pax_size(pax["size"])
    if info.isdir():
        info.name = info.name.rstrip("/")


# The pax keys the parser acts on; the others are dropped as they are read, so that global records
# (which apply to every later member) stay a few keys however many global headers an archive has.
_ACTED_ON = ("path", "linkpath", "size")
_SPARSE = "GNU.sparse."  # stands for any GNU.sparse.* key: the member is refused


def _padded(size: int) -> int:
    return size + (-size % tarfile.BLOCKSIZE)


def _pax_records(data: bytes, archive: Path) -> dict[str, str]:
    """The `length key=value\\n` records of a pax header that the parser acts on (`_ACTED_ON`,
    and `_SPARSE` for any GNU.sparse.* key); a `path` or `linkpath` that could not name a member
    inside the archive's folder refuses the archive."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise tarfile.HeaderError("invalid pax header") from None
        record = data[space + 1 : pos + length]
        if length <= 0 or space < 0 or pos + length > len(data) or not record.endswith(b"\n"):
            raise tarfile.HeaderError("invalid pax header")
        key, sep, value = record[:-1].partition(b"=")
        if not sep:
            raise tarfile.HeaderError("invalid pax header")
        name, text = (part.decode("utf-8", "surrogateescape") for part in (key, value))
        if name in ("path", "linkpath") and (problem := _name_problem(text)) is not None:
            raise _refuse(archive, text, problem)
        if name in _ACTED_ON:
            records[name] = text
        elif name.startswith(_SPARSE):
            records[_SPARSE] = ""
        pos += length
    return records


def _pax_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise tarfile.HeaderError(f"invalid pax size {value!r}") from None
    if size < 0:
        raise tarfile.HeaderError(f"invalid pax size {value!r}")
    return size
