"""`fastdata.write.permfile`: the file holds `default_rng(seed).permutation(n)` byte for byte.

Both shuffles are checked (the C extension `fastdata._shuffle` and the Python fallback), with the
default window (small n: all in RAM) and with small windows (the steps whose j falls below the
window: the path every step of a large n takes), and the generator's state afterwards is numpy's.
The 64-bit draws (n > 2**32, not shufflable in a test) are checked draw by draw against numpy's
`next_uint64`/`next_uint32` function pointers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from fastdata.write import permfile
from fastdata.write.permfile import read_slice, write_permutation

SIZES = (0, 1, 2, 3, 7, 255, 256, 1000, 65537, 300_000)
SEEDS = (0, 12345, [7, zlib.crc32(b"train")], [2**40 + 1, zlib.crc32(b"val")])

needs_c = pytest.mark.skipif(
    permfile._shuffle is None,
    reason="fastdata._shuffle is not built (no C compiler at install, or not built in place)",
)


@pytest.fixture(params=["c", "python"])
def impl(request, monkeypatch) -> str:
    """Which shuffle write_permutation uses: the C extension, or the fallback (extension None)."""
    if request.param == "c":
        if permfile._shuffle is None:
            pytest.skip("fastdata._shuffle is not built (no C compiler at install)")
    else:
        monkeypatch.setattr(permfile, "_shuffle", None)
    return request.param


def _shuffle_fn(impl: str):
    return permfile._shuffle_c if impl == "c" else permfile._shuffle_python


def _arange_file(path: Path, n: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.write(fd, np.arange(n, dtype=np.int64).tobytes())
    return fd


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: repr(s).replace(" ", ""))
@pytest.mark.parametrize("n", SIZES)
def test_file_is_numpys_permutation(tmp_path: Path, impl: str, n: int, seed) -> None:
    path = tmp_path / "p.perm"
    write_permutation(path, n, seed)
    want = np.random.default_rng(seed).permutation(n)
    assert want.dtype == np.int64
    assert path.read_bytes() == want.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.perm"]  # no temporary file left


@pytest.mark.parametrize(
    ("n", "window"),
    [(2, 1), (3, 1), (7, 2), (255, 3), (256, 16), (1000, 7), (65537, 1000), (300_000, 4096)],
)
def test_small_windows(tmp_path: Path, impl: str, n: int, window: int) -> None:
    """Steps below the window read and write the file; numpy's draws and end state, still."""
    seed = [5, zlib.crc32(b"train")]
    fd = _arange_file(tmp_path / "p", n)
    rng = np.random.default_rng(seed)
    try:
        _shuffle_fn(impl)(fd, n, rng, window)
    finally:
        os.close(fd)
    reference = np.random.default_rng(seed)
    want = reference.permutation(n)
    assert (tmp_path / "p").read_bytes() == want.tobytes()
    assert rng.bit_generator.state == reference.bit_generator.state


def test_chunks_and_window_setting(tmp_path: Path, impl: str, monkeypatch) -> None:
    """A chunk that does not divide n, and the module's WINDOW (read at call time)."""
    monkeypatch.setattr(permfile, "WINDOW", 333)
    write_permutation(tmp_path / "p", 10_001, 3, chunk=1000)
    assert (tmp_path / "p").read_bytes() == np.random.default_rng(3).permutation(10_001).tobytes()


def test_read_slice(tmp_path: Path) -> None:
    n, seed = 65537, [11, zlib.crc32(b"test")]
    path = tmp_path / "p.perm"
    write_permutation(path, n, seed)
    want = np.random.default_rng(seed).permutation(n)
    for start, stop in [(0, n), (0, 0), (5, 5), (0, 1), (1000, 2024), (n - 3, n), (n, n)]:
        got = read_slice(path, start, stop)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want[start:stop])
    for start, stop in [(-1, 3), (3, 2), (0, n + 1), (n + 1, n + 1)]:
        with pytest.raises(ValueError, match=r"p\.perm.*out of bounds"):
            read_slice(path, start, stop)


def test_read_slice_ragged_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.perm"
    path.write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match=r"bad\.perm.*no whole number"):
        read_slice(path, 0, 1)


def test_overwrites_atomically(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "p.perm"
    write_permutation(path, 1000, 1)
    write_permutation(path, 10, 2)
    assert path.read_bytes() == np.random.default_rng(2).permutation(10).tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["p.perm"]


class Boom(Exception):
    pass


def _raise(*args, **kwargs):
    raise Boom


@pytest.mark.parametrize("where", ["arange", "shuffle", "rename"])
def test_failure_leaves_nothing(tmp_path: Path, impl: str, monkeypatch, where: str) -> None:
    """An error while writing 0..n-1, while shuffling or at the rename: no file, no temporary,
    and an older file of that name stays as it was."""
    calls = []

    def second_write_fails(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise Boom
        real(fd, data, offset)

    real = permfile._pwrite_all
    if where == "arange":
        monkeypatch.setattr(permfile, "_pwrite_all", second_write_fails)
    elif where == "shuffle":
        monkeypatch.setattr(permfile, "_shuffle_c" if impl == "c" else "_shuffle_python", _raise)
    else:
        monkeypatch.setattr(permfile.os, "replace", _raise)
    with pytest.raises(Boom):
        write_permutation(tmp_path / "new.perm", 5000, 0, chunk=1000)
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old.perm"
    old.write_bytes(b"old bytes")
    calls.clear()
    with pytest.raises(Boom):
        write_permutation(old, 5000, 0, chunk=1000)
    assert [p.name for p in tmp_path.iterdir()] == ["old.perm"]
    assert old.read_bytes() == b"old bytes"


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n must be"):
        write_permutation(tmp_path / "p", -1, 0)
    with pytest.raises(ValueError, match="chunk must be"):
        write_permutation(tmp_path / "p", 10, 0, chunk=0)
    assert list(tmp_path.iterdir()) == []


@needs_c
def test_c_errors(tmp_path: Path) -> None:
    """A file shorter than n values: ValueError; a failed write: OSError with the errno."""
    assert permfile._shuffle is not None
    rng = np.random.default_rng(0)
    funcs = rng.bit_generator.ctypes
    addresses = (
        funcs.state_address,
        ctypes.cast(funcs.next_uint32, ctypes.c_void_p).value,
        ctypes.cast(funcs.next_uint64, ctypes.c_void_p).value,
    )
    fd = _arange_file(tmp_path / "p", 100)
    try:
        with pytest.raises(ValueError, match="fewer than n"):
            permfile._shuffle.permute_file(fd, 101, *addresses)
        with pytest.raises(ValueError, match="n must be"):
            permfile._shuffle.permute_file(fd, -1, *addresses)
        with pytest.raises(ValueError, match="window must be"):
            permfile._shuffle.permute_file(fd, 100, *addresses, 0)
    finally:
        os.close(fd)
    fd = os.open(tmp_path / "p", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            permfile._shuffle.permute_file(fd, 100, *addresses, 10)
        assert failed.value.errno == errno.EBADF
    finally:
        os.close(fd)


def _numpy_interval(funcs, max_: int) -> int:
    """numpy's random_interval (distributions.c), drawing through the C function pointers."""
    if max_ == 0:
        return 0
    mask = max_
    for shift in (1, 2, 4, 8, 16, 32):
        mask |= mask >> shift
    while True:
        if max_ <= 0xFFFFFFFF:
            value = funcs.next_uint32(funcs.state_address) & mask
        else:
            value = funcs.next_uint64(funcs.state_address) & mask
        if value <= max_:
            return value


def test_fallback_draws_match_numpy_above_32_bits() -> None:
    """The fallback's random_interval, 64-bit branch included (n > 2**32 rows), against numpy's
    own next_uint64/next_uint32, 32-bit draws interleaved (the buffered high half survives a
    64-bit draw), across several blocks of raw draws; then the states agree."""
    maxes = [2**32, 2**32 + 1, 0xFFFFFFFF, 2**33 - 1, 3, 2**40 + 12345, 0, 1, 2**62 + 7]
    maxes += [2**63 - 1, 5 * 2**31, 2**31, 77, 2**35 + 3]
    maxes *= 3000  # > _Draws.BLOCK raw draws: the block refills in the middle
    seed = [7, zlib.crc32(b"train")]
    ours = np.random.default_rng(seed)
    draws = permfile._Draws(ours.bit_generator)
    theirs = np.random.default_rng(seed)
    funcs = theirs.bit_generator.ctypes
    got = [draws.interval(m) for m in maxes]
    want = [_numpy_interval(funcs, m) for m in maxes]
    assert got == want
    assert all(0 <= v <= m for v, m in zip(got, maxes, strict=True))
    assert any(v > 0xFFFFFFFF for v in got)
    draws.sync()
    assert ours.bit_generator.state == theirs.bit_generator.state


def test_fallback_draws_start_from_buffered_half() -> None:
    """A generator whose state holds a buffered 32-bit half: the fallback uses it first."""
    ours, theirs = np.random.default_rng(9), np.random.default_rng(9)
    ours.bit_generator.ctypes.next_uint32(ours.bit_generator.ctypes.state_address)
    theirs.bit_generator.ctypes.next_uint32(theirs.bit_generator.ctypes.state_address)
    assert ours.bit_generator.state["has_uint32"] == 1
    draws = permfile._Draws(ours.bit_generator)
    maxes = [1000, 2**33, 5, 2**20, 0xFFFFFFFF]
    assert [draws.interval(m) for m in maxes] == [
        _numpy_interval(theirs.bit_generator.ctypes, m) for m in maxes
    ]
    draws.sync()
    assert ours.bit_generator.state == theirs.bit_generator.state
