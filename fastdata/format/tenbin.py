"""webdataset's `.ten` members (its `tenbin` format), read as untrusted input.

A `.ten` member is a series of chunks, each `~TenBin~` (8 bytes), its length (int64), then its
bytes padded to a multiple of 64; chunks pair up as (header, data) per array, a header being
int64s: dtype code (`f4`, `i8`, ...), an 8-byte info string, the rank, then each dimension. Every
length, rank and shape is checked against the bytes there before anything is allocated: a header
may claim any size. Integers are little-endian, as webdataset writes them on every machine it
runs on (`struct` native order on x86 and ARM).
"""

from __future__ import annotations

import numpy as np

__all__ = ["TenbinError", "decode_tenbin", "encode_tenbin"]

_MAGIC = b"~TenBin~"
_DTYPES = {
    b"f2": "<f2",
    b"f4": "<f4",
    b"f8": "<f8",
    b"i1": "i1",
    b"i2": "<i2",
    b"i4": "<i4",
    b"i8": "<i8",
    b"u1": "u1",
    b"u2": "<u2",
    b"u4": "<u4",
    b"u8": "<u8",
}
_MAX_RANK = 9  # webdataset's encoder refuses 10 or more dimensions


class TenbinError(ValueError):
    """A `.ten` member that is not a well-formed tenbin buffer (says what is wrong)."""


def _chunks(buf: bytes) -> list[bytes]:
    out, offset, total = [], 0, len(buf)
    while offset < total:
        if buf[offset : offset + 8] != _MAGIC:
            raise TenbinError(f"no '~TenBin~' magic at byte {offset}")
        if offset + 16 > total:
            raise TenbinError(f"a chunk header at byte {offset} is cut short")
        size = int.from_bytes(buf[offset + 8 : offset + 16], "little", signed=True)
        start = offset + 16
        if size < 0 or start + size > total:
            raise TenbinError(
                f"a chunk at byte {offset} claims {size} bytes; {total - start} follow"
            )
        out.append(buf[start : start + size])
        offset = start + -(-size // 64) * 64
    return out


def decode_tenbin(data: bytes | memoryview) -> list[np.ndarray]:
    """The arrays of a `.ten` member, in order (read-only views of a copy of `data`).

    Raises:
        TenbinError: a missing magic, a length or shape that the bytes do not hold, an unknown
            dtype, an odd number of chunks (a header without its data).
    """
    chunks = _chunks(bytes(data))
    if len(chunks) % 2:
        raise TenbinError(f"{len(chunks)} chunks: each array is a header chunk and a data chunk")
    arrays = []
    for header, body in zip(chunks[::2], chunks[1::2], strict=True):
        if len(header) < 24 or len(header) % 8:
            raise TenbinError(f"an array header of {len(header)} bytes (at least 24, 8-aligned)")
        code = header[:8].rstrip(b"\0")
        if code not in _DTYPES:
            raise TenbinError(f"unknown dtype code {code!r}; known: {sorted(_DTYPES)}")
        rank = int.from_bytes(header[16:24], "little", signed=True)
        if not 0 <= rank <= _MAX_RANK or len(header) < 24 + 8 * rank:
            raise TenbinError(f"rank {rank} in a header of {len(header)} bytes")
        shape = tuple(np.frombuffer(header[24 : 24 + 8 * rank], dtype="<i8").tolist())
        dtype = np.dtype(_DTYPES[code])
        if any(d < 0 for d in shape) or int(np.prod(shape, dtype=object)) * dtype.itemsize != len(
            body
        ):
            raise TenbinError(f"shape {shape} of {dtype} does not match {len(body)} data bytes")
        arrays.append(np.frombuffer(body, dtype=dtype).reshape(shape))
    return arrays


def encode_tenbin(arrays: list[np.ndarray]) -> bytes:
    """A `.ten` member holding `arrays`, as webdataset's `tenbin.encode_buffer` writes it."""
    inverse = {np.dtype(v).str: k for k, v in _DTYPES.items()}
    out = bytearray()
    for array in arrays:
        array = np.ascontiguousarray(array)
        code = inverse.get(array.dtype.newbyteorder("<").str)
        if code is None or array.ndim > _MAX_RANK:
            raise TenbinError(f"cannot store {array.dtype} {array.shape} in a .ten member")
        header = (
            code.ljust(8, b"\0")
            + bytes(8)
            + np.array([array.ndim, *array.shape], dtype="<i8").tobytes()
        )
        for chunk in (header, array.astype(array.dtype.newbyteorder("<")).tobytes()):
            out += _MAGIC + len(chunk).to_bytes(8, "little") + chunk
            out += bytes(-len(chunk) % 64)
    return bytes(out)
