"""A shard's index: which bytes of the tar hold each sample's components.

The DALI index written beside each shard (`fastdata.write.tarshard`) lists every component's
byte offset and size; `ShardIndex` is it parsed. It is read from the index file (checked against
the manifest's `index_sha256`), or, for a shard without one, made by scanning the tar.
`fastdata.read.shardio.ShardReader` reads samples by random access through it.
"""

from __future__ import annotations

import mmap
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastdata.format.integrity import (
    IntegrityError,
    ShardReadError,
    check_digest,
    layout_of_tokens,
    read_checked,
)
from fastdata.format.manifest import ShardInfo
from fastdata.format.schema import split_member

__all__ = [
    "ShardIndex",
    "check_index_count",
    "index_from_tar",
    "load_index",
    "parse_index",
    "read_index_file",
]


@dataclass(frozen=True)
class ShardIndex:
    """A parsed index: the key of each sample and its components' (offset, size) by extension.

    `layout`: ext -> (offsets, sizes) arrays when every line lists the same components (what
    `fastdata.format.integrity.scan_shard` checks at once); None otherwise.
    """

    keys: list[str]
    components: Sequence[dict[str, tuple[int, int]]]
    layout: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.keys)


def parse_index(text: str, shard: str) -> ShardIndex:
    """Parse DALI's `v1.2` webdataset index (see fastdata.write.tarshard).

    An index whose lines all list the same components is parsed with array operations; any
    other goes line by line, and an error names the shard and the line. (That each component's
    tar header names the sample's key + "." + component is checked against the tar by
    `ShardReader`, not here.)
    """
    fast = _parse_uniform(text)
    if fast is not None:
        return fast
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
        try:
            for i in range(0, len(fields), 4):
                ext, offset, size, name = fields[i : i + 4]
                entry[ext] = (int(offset), int(size))
        except ValueError:
            raise ShardReadError(
                shard, None, f"index line {number} has a non-number offset or size: {line[:80]!r}"
            ) from None
        if min(min(pair) for pair in entry.values()) < 0:
            raise ShardReadError(shard, None, f"index line {number} has a negative number")
        keys.append(_key_of(name))
        components.append(entry)
    head = lines[0].split()
    if len(head) != 2 or not head[1].isdigit():
        raise ShardReadError(shard, None, f"index header {lines[0][:80]!r} is not 'v1.x N'")
    declared = int(head[1])
    if declared != len(keys):
        raise ShardReadError(
            shard, None, f"index declares {declared} samples but lists {len(keys)}"
        )
    return ShardIndex(keys, components)


def _parse_uniform(text: str) -> ShardIndex | None:
    """`parse_index` of an index whose lines all list the same components; None for any other
    (or anything wrong: the line-by-line parser then says what)."""
    tokens = text.split()
    if len(tokens) < 2 or not tokens[1].isdigit():
        return None
    n = int(tokens[1])
    layout = layout_of_tokens(tokens, n)
    if layout is None or text.strip().count("\n") != n:
        return None
    exts = list(layout)
    # The key of a line is its last member's (as the line parser takes it); whether each
    # member's tar header names key + "." + component is checked against the tar itself.
    keys = [_key_of(m) for m in tokens[2:][4 * len(exts) - 1 :: 4 * len(exts)]]
    if min(min(o.min(), s.min()) for o, s in layout.values()) < 0:
        return None
    return ShardIndex(keys, _Components(layout), layout)


class _Components(Sequence[dict[str, tuple[int, int]]]):
    """`ShardIndex.components` of a uniform index: each sample's dict made when it is read.

    Making all of them when a shard is opened cost ~60 ms of a loader worker's CPU per
    10,000-sample shard, every epoch, whether or not its samples were read one by one.
    """

    def __init__(self, layout: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self._columns = [(ext, o.tolist(), s.tolist()) for ext, (o, s) in layout.items()]
        self._n = len(self._columns[0][1]) if self._columns else 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override] - ints only (slices: a list)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(f"sample {i} of an index of {self._n}")
        return {ext: (offsets[i], sizes[i]) for ext, offsets, sizes in self._columns}


def _key_of(member: str) -> str:
    """The sample key of a member name, as webdataset groups members (`schema.split_member`):
    the path up to the first dot of the base name (this project's keys hold no '/' or '.')."""
    if "/" not in member:
        return member.partition(".")[0]
    parsed = split_member(member)
    return parsed[0] if parsed is not None else member


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
                parsed = split_member(member.name)
                if parsed is None:
                    raise ShardReadError(
                        shard, None, f"tar member {member.name!r} belongs to no sample"
                    )
                key, ext = parsed
                if not keys or keys[-1] != key:
                    keys.append(key)
                    components.append({})
                components[-1][ext] = (member.offset_data, member.size)
    except tarfile.TarError as exc:
        raise ShardReadError(shard, keys[-1] if keys else None, f"corrupt tar ({exc})") from exc
    return ShardIndex(keys, components)


def load_index(path: str | None, info: ShardInfo, data: bytes | mmap.mmap) -> ShardIndex:
    """The index file at `path` (`read_index_file`); the tar scanned when there is none."""
    if path is None:
        return index_from_tar(data, info.name)
    try:
        return read_index_file(path, info)
    except FileNotFoundError:
        return index_from_tar(data, info.name)


def read_index_file(path: str, info: ShardInfo) -> ShardIndex:
    """The shard's index file at `path` (local, or a URL: `fastdata verify`, a shard given by
    `use_bytes`), checked against the manifest's `index_sha256`, parsed.

    Raises:
        FileNotFoundError: there is no index file (readers scan the tar instead).
        ShardReadError: it cannot be read, or differs from its sha256.
    """
    try:
        if "://" in path:
            from fastdata.remote.fs import read_bytes

            raw = read_bytes(path)
            check_digest(raw, info.index_sha256, "index file", path)
        else:
            raw = read_checked(path, info.index_sha256, "index file")
    except FileNotFoundError:
        raise
    except (OSError, RuntimeError, IntegrityError) as exc:  # RuntimeError: RemoteError
        raise ShardReadError(info.name, None, str(exc)) from exc
    return parse_index(raw.decode("utf-8", errors="replace"), info.name)


def check_index_count(index: ShardIndex, info: ShardInfo) -> None:
    """Raise ShardReadError unless the index lists the manifest's number of samples."""
    if len(index) != info.num_samples:
        raise ShardReadError(
            info.name,
            None,
            f"index lists {len(index)} samples but the manifest says {info.num_samples}",
        )
