"""A split's permutation in a file: `Generator.permutation(n)`, byte for byte, in flat memory.

`fastdata shard` orders each split by ``np.random.default_rng(seed).permutation(count)``. That
int64 array costs 8 bytes a row in RAM: 800 MB for 100 million rows, held while the shards are
planned. `write_permutation` writes the same numbers to a file instead, and each shard job reads
its own slice back with `read_slice`.

How: the file is first written with 0..n-1 (in chunks), then shuffled in place with numpy's own
algorithm (`Generator.shuffle` of a 1-D array, which `permutation(n)` runs on ``arange(n)``):
Fisher-Yates from the top, ``for i in n-1..1: j = random_interval(i); swap(a[i], a[j])``, with
numpy's `random_interval` (a mask-and-reject draw of ``next_uint32`` for i <= 0xffffffff,
``next_uint64`` above) on a fresh ``default_rng(seed)``. The file therefore holds exactly
``default_rng(seed).permutation(n)`` as native-endian int64 (tests/write/test_permfile.py
compares the two).

The file's pages live in the page cache, not in the process: the process holds one window of the
top positions (`WINDOW` values, 2 MB; position i is final once step i is done) and the rest is read and
written 8 bytes at a time. Two paths do the shuffle:

- the C extension `fastdata._shuffle` (fastdata/_shuffle.c, built at install; optional): it draws
  through the bit generator's ctypes function pointers, so the draws are numpy's own;
- where it is not built, Python: the same windows and reads, the draws rebuilt from
  ``bit_generator.random_raw`` blocks (PCG64's ``next_uint32`` hands out the low 32 bits of a
  64-bit draw and keeps the high 32 bits for the next call), and the last window (the prefix
  [0, window)) handed to numpy's own ``Generator.shuffle``.

Cost: one pread and one pwrite of 8 bytes for each step whose j falls below the window, i.e.
nearly every step of a large n, so the time is the file system's: measured on ext4 (a VM), the C
extension took 1.25 s for 1M rows, 7.7 s for 3M and 150 s for 30M (~1-3 us an 8-byte pwrite), on
tmpfs 2.0 s for 3M and 26 s for 30M, where numpy's `permutation` takes 0.03, 0.11 and 1.5 s; the
Python fallback 1.8 s for 1M and 10 s for 3M on ext4. Peak RSS stays ~15 MB over the interpreter's
with numpy (30M rows: 67 MB against numpy's 285 MB).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import secrets
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["read_slice", "write_permutation"]

ITEM = 8  # bytes a value: int64, native endian
CHUNK = 1 << 16  # values of 0..n-1 written at a time (512 KB)
WINDOW = 1 << 18  # values the shuffle holds in RAM (2 MB): the top positions being finalized


def _load_shuffle() -> ModuleType | None:
    # By name, not by an import statement: grimp (lint-imports) reads `import fastdata._shuffle`,
    # a C extension with no .py file, as an import of the package root, whose lazy API names
    # every layer (see pyproject's [tool.importlinter]).
    try:
        return importlib.import_module("fastdata._shuffle")
    except ImportError:
        return None


#: `fastdata._shuffle` (see fastdata/_shuffle.c), or None where it was not built.
_shuffle: ModuleType | None = _load_shuffle()


def write_permutation(
    path: Path, n: int, seed: Sequence[int] | int, chunk: int | None = None
) -> None:
    """Write ``np.random.default_rng(seed).permutation(n)`` to `path` as n native int64 values.

    The memory held does not grow with `n` (`chunk` values, default `CHUNK`, while writing
    0..n-1, then a window of `WINDOW` values while shuffling). The file is written under a temporary name beside `path`
    and renamed over it at the end: `path` is either absent (or its old self) or complete; the
    temporary file is removed on any error.
    """
    n = int(n)
    chunk = CHUNK if chunk is None else chunk
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            for start in range(0, n, chunk):
                values = np.arange(start, min(start + chunk, n), dtype=np.int64)
                _pwrite_all(fd, memoryview(values).cast("B"), start * ITEM)
            rng = np.random.default_rng(seed)
            if _shuffle is not None:
                _shuffle_c(fd, n, rng)
            else:
                _shuffle_python(fd, n, rng)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_slice(path: Path, start: int, stop: int) -> np.ndarray:
    """The int64 values at positions [start, stop) of a file of `write_permutation` (one read).

    The array is read-only (a view of the bytes read). Raises ValueError naming the file when
    the range is not inside it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        count = size // ITEM
        if size % ITEM:
            raise ValueError(f"{path}: {size} bytes is no whole number of int64 values")
        if not 0 <= start <= stop <= count:
            raise ValueError(
                f"{path}: slice [{start}, {stop}) is out of bounds for its {count} values"
            )
        data = _pread_all(fd, (stop - start) * ITEM, start * ITEM, path)
    finally:
        os.close(fd)
    return np.frombuffer(data, dtype=np.int64)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        put = os.pwrite(fd, data, offset)
        if put <= 0:
            raise OSError(f"pwrite wrote {put} bytes")
        data = data[put:]
        offset += put


def _pread_all(fd: int, size: int, offset: int, path: Path | None = None) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            where = f"{path}: " if path is not None else ""
            raise OSError(f"{where}short read: {got} of {size} bytes at offset {offset}")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _shuffle_c(fd: int, n: int, rng: np.random.Generator, window: int | None = None) -> None:
    """numpy's shuffle of the file's n values, in C, drawing through the bit generator."""
    assert _shuffle is not None
    bit_generator = rng.bit_generator
    funcs = bit_generator.ctypes
    next32 = ctypes.cast(funcs.next_uint32, ctypes.c_void_p).value
    next64 = ctypes.cast(funcs.next_uint64, ctypes.c_void_p).value
    args: tuple[Any, ...] = (fd, n, funcs.state_address, next32, next64)
    with bit_generator.lock:  # as numpy's shuffle holds it: no other thread draws meanwhile
        _shuffle.permute_file(*args, window if window is not None else WINDOW)


class _Draws:
    """numpy's `random_interval` over a PCG64-like bit generator, drawn in blocks from Python.

    ``next_uint64`` is one raw 64-bit draw; ``next_uint32`` returns the low half of a raw draw
    and keeps the high half for its next call (the state's ``has_uint32``/``uinteger``), exactly
    as numpy's C code. `sync` leaves the bit generator's state as numpy's own draws would have.
    """

    BLOCK = 1 << 14

    def __init__(self, bit_generator: np.random.BitGenerator) -> None:
        self._bg = bit_generator
        state = bit_generator.state
        if "has_uint32" not in state:
            raise TypeError(f"{type(bit_generator).__name__} does not buffer 32-bit draws")
        self._half: int | None = int(state["uinteger"]) if state["has_uint32"] else None
        self._uinteger = int(state["uinteger"])  # numpy keeps the last high half once used
        self._start = state  # the state before the current block
        self._raw: list[int] = []
        self._pos = 0

    def next64(self) -> int:
        if self._pos == len(self._raw):
            self._start = self._bg.state
            self._raw = self._bg.random_raw(self.BLOCK).tolist()
            self._pos = 0
        value = self._raw[self._pos]
        self._pos += 1
        return value

    def next32(self) -> int:
        if self._half is not None:
            value, self._half = self._half, None
            return value
        raw = self.next64()
        self._half = self._uinteger = raw >> 32
        return raw & 0xFFFFFFFF

    def interval(self, max_: int) -> int:
        """A value in [0, max_]: the smallest all-ones mask >= max_, draws until <= max_."""
        if max_ == 0:
            return 0
        mask = (1 << max_.bit_length()) - 1
        if max_ <= 0xFFFFFFFF:
            while (value := self.next32() & mask) > max_:
                pass
        else:
            while (value := self.next64() & mask) > max_:
                pass
        return value

    def sync(self) -> None:
        """Give the bit generator the state of the draws used so far (unused ones undone)."""
        self._bg.state = self._start
        if self._pos:
            self._bg.random_raw(self._pos)
        state = self._bg.state
        state["has_uint32"] = int(self._half is not None)
        state["uinteger"] = self._uinteger
        self._bg.state = state
        self._start, self._raw, self._pos = state, [], 0


def _shuffle_python(fd: int, n: int, rng: np.random.Generator, window: int | None = None) -> None:
    """numpy's shuffle of the file's n values in Python (where the C extension is not built).

    The windows above the prefix [0, window) run the Fisher-Yates steps here; the prefix, the
    last window, is numpy's own shuffle of it, continuing from the same state.
    """
    window = WINDOW if window is None else window
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    draws = _Draws(rng.bit_generator)
    value = struct.Struct("=q")
    pread, pwrite = os.pread, os.pwrite
    hi = n
    while hi > window:
        lo = hi - window
        top = array("q", _pread_all(fd, window * ITEM, lo * ITEM))  # indexes faster than numpy
        interval, unpack, pack = draws.interval, value.unpack, value.pack
        for i in range(hi - 1, lo - 1, -1):
            j = interval(i)
            k = i - lo
            if j >= lo:
                top[k], top[j - lo] = top[j - lo], top[k]
            else:
                raw = pread(fd, ITEM, j * ITEM)
                if len(raw) != ITEM:
                    raise OSError(f"short read of 8 bytes at offset {j * ITEM}")
                if pwrite(fd, pack(top[k]), j * ITEM) != ITEM:
                    raise OSError(f"short write of 8 bytes at offset {j * ITEM}")
                top[k] = unpack(raw)[0]
        _pwrite_all(fd, memoryview(top).cast("B"), lo * ITEM)
        hi = lo
    draws.sync()  # the state numpy's draws leave (the prefix's shuffle continues from it)
    if hi > 1:
        prefix = np.frombuffer(bytearray(_pread_all(fd, hi * ITEM, 0)), dtype=np.int64)
        rng.shuffle(prefix)
        _pwrite_all(fd, memoryview(prefix).cast("B"), 0)
