"""Scanning one WebDataset tar written by any tool, without changing a byte of it.

`scan_tar` reads a tar once, as a stream (a local file or an HTTP body), and returns what
`fastdata index` records about it: its size and sha256, the DALI index text (the same `v1.2`
format `fastdata.write.tarshard` writes), the per-sample digests (`fastdata.format.schema.sums_text`),
each sample's components and its `cls` label.

Members are grouped into samples as webdataset groups them (`fastdata.format.schema.split_member`,
webdataset's `base_plus_ext`): the key is the member's path up to the first dot of its base name
(`a.v1/b/c.d.jpg` -> key `a.v1/b/c`, component `d.jpg`); components differ by more than case,
as webdataset lower-cases them; `__meta__` members are skipped, as webdataset's
`tar_file_iterator` skips them. Where webdataset drops a member silently (no dot in its base
name) or makes a key of a folder (`dir/.hidden` -> key `dir/`), the tar is refused naming the
member: such a member is no sample's data. Any header webdataset's writer or GNU tar emits is
accepted (other modes, mtimes, user names, GNU long names, PAX headers, members in directories).

Each sample's image size is read from its image's header (JPEG SOF, PNG IHDR: no pixel is
decoded), so the manifest records sizes as `fastdata shard` does. A gzip-compressed component
(`txt.gz`, `cls.gz`, ...) is decompressed once, bounded (`fastdata.format.fields.gunzip_bounded`), so a
bad or bomb one is named here rather than in a training run.

The tar is untrusted input: a member that belongs to no sample (no extension), a path that
leaves the archive (`..`, absolute), a link or device member, a duplicated component, a tar cut
short or with garbage where a header belongs, each raise `ForeignTarError` naming the tar and
the member.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO

from fastdata.format.fields import GZ_SUFFIX, FieldError, gunzip_bounded
from fastdata.format.integrity import check_header
from fastdata.format.schema import sample_digest, split_member, sums_text
from fastdata.write.tarshard import INDEX_VERSION

__all__ = ["ForeignTarError", "ScannedTar", "scan_tar"]

_BLOCK = 512
#: Bytes of the stream kept behind the read position: a member's header is always in it when
#: tarfile hands the member out (tarfile reads ahead at most one 10 KiB record).
_TAIL = 1 << 20


#: The largest tar member `fastdata index` reads (each member of a sample is held whole).
MAX_MEMBER_BYTES = 1 << 30
#: Members webdataset's `tar_file_iterator` skips as metadata (its `skip_meta` and `__x__` names).
_META = re.compile(r"__[^/]*__($|/)")
#: Image components whose header gives the sample's image size.
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class ForeignTarError(ValueError):
    """A foreign tar cannot be indexed as it is; the message names the tar and the member."""


@dataclass
class ScannedTar:
    """What `fastdata index` records about one tar.

    Args:
        name: the tar's name relative to the dataset's data root.
        bytes: the tar's size.
        sha256: hex sha256 of the whole file.
        keys: each sample's key, in tar order.
        components: each sample's components (tar member extensions), in tar order.
        labels: each sample's `cls` value (None where it has none).
        sizes: each sample's image (height, width) from its header (None: no image, or a
            header that cannot be read here).
        index_text: the DALI index (`v1.2 N` then one line per sample).
        sums_text: the per-sample digest file.
    """

    name: str
    bytes: int = 0
    sha256: str = ""
    keys: list[str] = field(default_factory=list)
    components: list[tuple[str, ...]] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)
    sizes: list[tuple[int, int] | None] = field(default_factory=list)
    index_text: str = ""
    sums_text: str = ""

    @property
    def num_samples(self) -> int:
        return len(self.keys)


class _HashingReader(io.RawIOBase):
    """A read-only stream that hashes and counts what passes through and keeps its last bytes."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.position = 0
        self.tail = bytearray()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.digest.update(data)
        self.position += n
        self.tail += data
        if len(self.tail) > 2 * _TAIL:
            del self.tail[: len(self.tail) - _TAIL]
        return n

    def window(self, start: int, size: int) -> bytes | None:
        """Bytes [start, start + size) of the stream, if still kept (None otherwise)."""
        first = self.position - len(self.tail)
        if start < first or start + size > self.position:
            return None
        return bytes(self.tail[start - first : start - first + size])

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def scan_tar(stream: BinaryIO, name: str, where: str | None = None) -> ScannedTar:
    """Index one tar read from `stream` (read to its end, never written).

    Args:
        stream: the tar's bytes, from the start (a file or an HTTP body).
        name: the tar's name relative to the data root (recorded in the index lines' owner).
        where: how errors name the tar (default: `name`).

    Raises:
        ForeignTarError: a member outside any sample, a path leaving the archive, a link or
            special member, a component twice in one sample, whitespace in a member name, a
            `cls` that is not a non-negative integer, a truncated or corrupt tar, or a tar
            with no sample (names the tar and the member).
    """
    where = where or name
    reader = _HashingReader(stream)
    out = ScannedTar(name)
    lines: list[str] = []
    digests: list[str] = []
    group: dict[str, bytes] = {}
    entries: list[str] = []
    last_member = None
    end = 0  # where the last member's data (padded) ends

    def close_group() -> None:
        if not group:
            return
        digests.append(sample_digest(group))
        lines.append(" ".join(entries))
        key = out.keys[-1]
        out.components.append(tuple(group))
        plain = {ext.lower(): data for ext, data in group.items()}
        for ext, data in plain.items():
            if ext.endswith(GZ_SUFFIX):
                try:
                    plain[ext] = gunzip_bounded(data, ext)
                except FieldError as exc:
                    raise ForeignTarError(f"{where}: sample {key!r}: {exc}") from exc
        label = plain.get("cls", plain.get("cls" + GZ_SUFFIX))
        out.labels.append(_label(label, where, key))
        _check_lid(plain.get("lid"), out.labels[-1], where, key)
        out.sizes.append(_image_size(plain))
        group.clear()
        entries.clear()

    try:
        buffered = io.BufferedReader(reader, buffer_size=64 << 10)
        with tarfile.open(fileobj=buffered, mode="r|") as tar:
            for member in tar:
                last_member = member.name
                if member.isdir():
                    end = member.offset_data
                    continue
                if _is_meta(member.name):  # webdataset's metadata, no sample's: not indexed
                    end = member.offset_data + member.size + (-member.size % _BLOCK)
                    continue
                member_where = f"{where}: member {member.name!r}"
                if not member.isreg() or member.issparse():
                    raise ForeignTarError(
                        f"{member_where} is a link, sparse or special file, not a sample's "
                        "data in one piece; re-write the tar with regular members only"
                    )
                _check_member_name(member.name, member_where)
                parsed = split_member(member.name)
                if parsed is None:
                    raise ForeignTarError(
                        f"{member_where} belongs to no sample (a sample's member is "
                        "KEY.COMPONENT, e.g. 000001.jpg); remove it from the tar"
                    )
                key, ext = parsed
                header = reader.window(member.offset_data - _BLOCK, _BLOCK)
                problem = (
                    "its header is no longer in the read window"
                    if header is None
                    else check_header(header, _BLOCK, member.size, member.name)
                )
                if problem is not None:
                    raise ForeignTarError(f"{member_where}: {problem}")
                if not group or out.keys[-1] != key:
                    close_group()
                    out.keys.append(key)
                elif ext.lower() in {e.lower() for e in group}:
                    raise ForeignTarError(
                        f"{member_where}: sample {key!r} holds component {ext!r} twice "
                        "(components are compared ignoring case, as webdataset lower-cases them)"
                    )
                if member.size > MAX_MEMBER_BYTES:  # read whole below: bound it first
                    raise ForeignTarError(
                        f"{member_where} is {member.size} bytes, more than a sample component "
                        f"may be ({MAX_MEMBER_BYTES}); it is not a dataset sample"
                    )
                file = tar.extractfile(member)
                data = file.read() if file is not None else b""
                group[ext] = data
                entries.append(f"{ext} {member.offset_data} {member.size} {member.name}")
                end = member.offset_data + member.size + (-member.size % _BLOCK)
            close_group()
            stop = tar.offset  # where tarfile stopped: the end-of-archive block, if whole
        marker = reader.window(stop, _BLOCK)
        reader.drain()
    except tarfile.TarError as exc:
        after = f" after member {last_member!r}" if last_member else ""
        raise ForeignTarError(
            f"{where}: not a readable uncompressed tar ({exc}){after}: it is truncated or "
            "corrupt; download or write it again"
        ) from exc
    if marker is None or marker != bytes(_BLOCK) or stop < end:
        after = f" after member {last_member!r}" if last_member else ""
        raise ForeignTarError(
            f"{where}: the tar ends without its end-of-archive block{after} (at byte {stop} of "
            f"{reader.position}): it is truncated or has garbage where a header belongs; "
            "download or write it again"
        )
    if not out.keys:
        raise ForeignTarError(f"{where}: the tar holds no sample")
    out.bytes = reader.position
    out.sha256 = reader.digest.hexdigest()
    out.index_text = f"{INDEX_VERSION} {len(lines)}\n" + "".join(line + "\n" for line in lines)
    out.sums_text = sums_text(out.keys, digests)
    return out


def _is_meta(name: str) -> bool:
    """Whether webdataset skips member `name` as metadata (`__meta__`, `__x__/...`)."""
    return bool(_META.match(name)) or (
        "/" not in name and name.startswith("__") and name.endswith("__")
    )


def _image_size(plain: dict[str, bytes]) -> tuple[int, int] | None:
    """(height, width) of a sample's image from its header (JPEG SOF, PNG IHDR; no decode)."""
    from fastdata.write.images import UnreadableImage, header_size

    data = next((plain[e] for e in _IMAGE_EXTS if e in plain), None)
    if data is None:
        return None
    try:
        size = header_size(data)
    except UnreadableImage:  # a bomb-sized header: the readers refuse it when they reach it
        return None
    return None if size is None else (size[1], size[0])


def _check_member_name(member: str, where: str) -> None:
    parts = member.split("/")
    if member.startswith("/") or ".." in parts or "\\" in member or "\x00" in member:
        raise ForeignTarError(
            f"{where} has a path that leaves the archive ('..', a leading '/' or a '\\'); "
            "refusing the tar"
        )
    if any(ch.isspace() for ch in member):
        raise ForeignTarError(
            f"{where} has whitespace in its name, which the DALI index format cannot hold; "
            "rename the member"
        )


def _check_lid(data: bytes | None, label: int | None, where: str, key: str) -> None:
    """A `lid` member (fastdata's binary label) must be 16 bytes and agree with `cls`: readers
    that take the label from `lid` and those that take it from `cls` must deliver one label."""
    if data is None:
        return
    if len(data) != 16 or label is None or int.from_bytes(data[:8], "little", signed=True) != label:
        raise ForeignTarError(
            f"{where}: sample {key!r} has a 'lid' member that is not 16 bytes holding its 'cls' "
            f"label ({label}); readers would disagree on its label: leave 'lid' out of the tar"
        )


def _label(data: bytes | None, where: str, key: str) -> int | None:
    if data is None:
        return None
    try:
        label = int(data.strip())
    except ValueError:
        label = -1
    if label < 0:
        raise ForeignTarError(
            f"{where}: sample {key!r} has 'cls' {data[:40]!r}, not a class index (an integer "
            ">= 0); fix the tar or leave the cls member out"
        )
    return label
