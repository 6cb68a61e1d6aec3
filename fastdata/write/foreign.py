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

import io
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from fastdata.format.fields import GZ_SUFFIX, FieldError, gunzip_bounded
from fastdata.format.integrity import check_header
from fastdata.format.schema import sample_digest, split_member, sums_text
from fastdata.write.tarshard import INDEX_VERSION
from fastdata.write.tarstream import HashingReader

__all__ = [
    "ForeignTarError",
    "Member",
    "Sample",
    "ScannedTar",
    "TarPosition",
    "check_samples",
    "digest_samples",
    "group_by_key",
    "index_rows",
    "scan_tar",
    "tar_members",
]

_BLOCK = 512


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


@dataclass
class TarPosition:
    """Where `tar_members` is in the tar, for the end-of-archive check and error messages."""

    last_member: str | None = None
    end: int = 0  # where the last member's data (padded) ends


@dataclass(frozen=True)
class Member:
    """One tar member that is a sample's component.

    Args:
        name: the member's path in the tar.
        key: the sample's key (`fastdata.format.schema.split_member`).
        component: its component (the extension after the key, as spelled in the tar).
        offset: where its data starts in the tar.
        size: its data's size.
        data: its data.
    """

    name: str
    key: str
    component: str
    offset: int
    size: int
    data: bytes = field(repr=False)


@dataclass
class Sample:
    """A sample: the consecutive members that share a key, in tar order; `label` (`cls`),
    `size` (the image's (height, width)) and `digest` once `check_samples` and
    `digest_samples` have seen it."""

    key: str
    members: list[Member]
    label: int | None = None
    size: tuple[int, int] | None = None
    digest: str = ""

    @property
    def parts(self) -> dict[str, bytes]:
        """Component -> bytes, as stored (a `.gz` one still compressed)."""
        return {m.component: m.data for m in self.members}


def scan_tar(stream: BinaryIO, name: str, where: str | None = None) -> ScannedTar:
    """Index one tar read from `stream` (read to its end, never written): the stages
    `tar_members` -> `group_by_key` -> `check_samples` -> `digest_samples` -> `index_rows`.

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
    reader = HashingReader(stream)
    position = TarPosition()
    try:
        buffered = io.BufferedReader(reader, buffer_size=64 << 10)
        with tarfile.open(fileobj=buffered, mode="r|") as tar:
            members = tar_members(tar, reader, where, position)
            samples = check_samples(group_by_key(members, where), where)
            out = index_rows(digest_samples(samples), name)
            stop = tar.offset  # where tarfile stopped: the end-of-archive block, if whole
        marker = reader.window(stop, _BLOCK)
        reader.drain()
    except tarfile.TarError as exc:
        raise ForeignTarError(
            f"{where}: not a readable uncompressed tar ({exc}){_after(position)}: it is "
            "truncated or corrupt; download or write it again"
        ) from exc
    if marker is None or marker != bytes(_BLOCK) or stop < position.end:
        raise ForeignTarError(
            f"{where}: the tar ends without its end-of-archive block{_after(position)} (at byte "
            f"{stop} of {reader.position}): it is truncated or has garbage where a header "
            "belongs; download or write it again"
        )
    if not out.keys:
        raise ForeignTarError(f"{where}: the tar holds no sample")
    out.bytes = reader.position
    out.sha256 = reader.digest.hexdigest()
    return out


def _after(position: TarPosition) -> str:
    return f" after member {position.last_member!r}" if position.last_member else ""


def tar_members(
    tar: tarfile.TarFile, reader: HashingReader, where: str, position: TarPosition
) -> Iterator[Member]:
    """The members of `tar` (opened as a stream over `reader`) that are samples' components,
    each checked alone (webdataset's `tar_file_iterator`); folders and webdataset's metadata
    are passed over. `position` follows the read.

    Raises:
        ForeignTarError: a link or special member, a path leaving the archive or holding
            whitespace, a member of no sample, a bad header, a member over `MAX_MEMBER_BYTES`.
    """
    for member in tar:
        position.last_member = member.name
        if member.isdir():
            position.end = member.offset_data
            continue
        padded_end = member.offset_data + member.size + (-member.size % _BLOCK)
        if _is_meta(member.name):  # webdataset's metadata, no sample's: not indexed
            position.end = padded_end
            continue
        key, ext = _check_member(member, reader, f"{where}: member {member.name!r}")
        file = tar.extractfile(member)
        data = file.read() if file is not None else b""
        position.end = padded_end
        yield Member(member.name, key, ext, member.offset_data, member.size, data)


def _check_member(member: tarfile.TarInfo, reader: HashingReader, where: str) -> tuple[str, str]:
    """(key, component) of a member that may be a sample's component (`tar_members`)."""
    if not member.isreg() or member.issparse():
        raise ForeignTarError(
            f"{where} is a link, sparse or special file, not a sample's data in one piece; "
            "re-write the tar with regular members only"
        )
    _check_member_name(member.name, where)
    parsed = split_member(member.name)
    if parsed is None:
        raise ForeignTarError(
            f"{where} belongs to no sample (a sample's member is KEY.COMPONENT, e.g. "
            "000001.jpg); remove it from the tar"
        )
    header = reader.window(member.offset_data - _BLOCK, _BLOCK)
    problem = (
        "its header is no longer in the read window"
        if header is None
        else check_header(header, _BLOCK, member.size, member.name)
    )
    if problem is not None:
        raise ForeignTarError(f"{where}: {problem}")
    if member.size > MAX_MEMBER_BYTES:  # read whole: bound it first
        raise ForeignTarError(
            f"{where} is {member.size} bytes, more than a sample component may be "
            f"({MAX_MEMBER_BYTES}); it is not a dataset sample"
        )
    return parsed


def group_by_key(members: Iterable[Member], where: str) -> Iterator[Sample]:
    """Consecutive members with one key, as one `Sample` (webdataset's `group_by_keys`).

    Raises:
        ForeignTarError: a component twice in one sample (compared ignoring case, as
            webdataset lower-cases them).
    """
    sample: Sample | None = None
    for member in members:
        if sample is None or sample.key != member.key:
            if sample is not None:
                yield sample
            sample = Sample(member.key, [])
        elif member.component.lower() in {m.component.lower() for m in sample.members}:
            raise ForeignTarError(
                f"{where}: member {member.name!r}: sample {member.key!r} holds component "
                f"{member.component!r} twice (components are compared ignoring case, as "
                "webdataset lower-cases them)"
            )
        sample.members.append(member)
    if sample is not None:
        yield sample


def check_samples(samples: Iterable[Sample], where: str) -> Iterator[Sample]:
    """Each sample with its `label` (its `cls`, or `cls.gz`) and image `size` (from the
    header), its `.gz` components inflated once, bounded, to check them.

    Raises:
        ForeignTarError: a `.gz` component that does not inflate (or a bomb), a `cls` that is
            not a class index, a `lid` that disagrees with `cls`.
    """
    for sample in samples:
        plain = {ext.lower(): data for ext, data in sample.parts.items()}
        for ext, data in plain.items():
            if ext.endswith(GZ_SUFFIX):
                try:
                    plain[ext] = gunzip_bounded(data, ext)
                except FieldError as exc:
                    raise ForeignTarError(f"{where}: sample {sample.key!r}: {exc}") from exc
        label = plain.get("cls", plain.get("cls" + GZ_SUFFIX))
        sample.label = _label(label, where, sample.key)
        _check_lid(plain.get("lid"), sample.label, where, sample.key)
        sample.size = _image_size(plain)
        yield sample


def digest_samples(samples: Iterable[Sample]) -> Iterator[Sample]:
    """Each sample with its digest (`fastdata.format.schema.sample_digest` of its components
    as stored), what `verify_samples=True` checks."""
    for sample in samples:
        sample.digest = sample_digest(sample.parts)
        yield sample


def index_rows(samples: Iterable[Sample], name: str) -> ScannedTar:
    """The tar's `ScannedTar` (its size and sha256 left to `scan_tar`): one DALI index line
    and one digest per sample, each sample's key, components, label and image size."""
    out = ScannedTar(name)
    lines: list[str] = []
    digests: list[str] = []
    for sample in samples:
        out.keys.append(sample.key)
        out.components.append(tuple(m.component for m in sample.members))
        out.labels.append(sample.label)
        out.sizes.append(sample.size)
        lines.append(
            " ".join(f"{m.component} {m.offset} {m.size} {m.name}" for m in sample.members)
        )
        digests.append(sample.digest)
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
