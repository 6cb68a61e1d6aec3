"""A tar read once as a stream: `HashingReader` hashes and counts the bytes that pass through it
and keeps the last of them, so that a member's raw header can be checked after tarfile parsed
it (`fastdata.write.foreign.tar_members`)."""

from __future__ import annotations

import hashlib
import io
from typing import BinaryIO

__all__ = ["HashingReader"]

#: Bytes of the stream kept behind the read position: a member's header is always in it when
#: tarfile hands the member out (tarfile reads ahead at most one 10 KiB record).
_TAIL = 1 << 20


class HashingReader(io.RawIOBase):
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
