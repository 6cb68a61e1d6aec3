"""Pure parts of the remote code: the size parser it shares, which failures are retried, the retry loop's bound."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdata._util import sizes
from fastdata.remote import RemoteError, RetryPolicy, parse_size
from fastdata.remote.retry import IntegrityError, is_transient, retry_call


def test_parse_size_is_the_one_size_grammar() -> None:
    """`fastdata.remote.parse_size` is `fastdata._util.sizes.parse_size` (its texts are tested in
    tests/util/test_sizes.py); a number of bytes passes through."""
    assert parse_size is sizes.parse_size
    assert parse_size(123) == 123


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (_Status(503), True),
        (_Status(429), True),
        (_Status(403), False),
        (_Status(400), False),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (IntegrityError("short"), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (ValueError("bad url"), False),
    ],
)
def test_which_failures_are_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_retry_stops_after_the_last_attempt_and_names_the_url() -> None:
    calls = []

    def always_reset() -> None:
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    policy = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.002)
    with pytest.raises(
        RemoteError, match=r"https://x/y.tar: download failed 3 times.*reset by peer"
    ):
        retry_call(always_reset, "https://x/y.tar", "download", policy, random.Random(0))
    assert len(calls) == 3


def test_retry_does_not_retry_a_missing_object() -> None:
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("s3://b/k")

    with pytest.raises(FileNotFoundError):
        retry_call(missing, "s3://b/k", "read", RetryPolicy(attempts=5, base_delay=0.001))
    assert len(calls) == 1


def test_backoff_grows_and_is_capped() -> None:
    policy, rng = RetryPolicy(base_delay=1.0, max_delay=8.0), random.Random(0)
    delays = [policy.delay(a, rng) for a in range(6)]
    assert 0.5 <= delays[0] <= 1.0 and 4.0 <= delays[5] <= 8.0
    assert all(d <= 8.0 for d in delays)


def test_every_protocol_gets_connect_and_read_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdata.remote import Timeouts
    from fastdata.remote.fs import with_timeouts

    timeouts = Timeouts(connect=3, read=7)
    http = with_timeouts("https://host/d", {"client_kwargs": {"trust_env": True}}, timeouts)
    client = http["client_kwargs"]
    assert client["trust_env"] is True  # the caller's options are kept
    assert (client["timeout"].sock_connect, client["timeout"].sock_read) == (3, 7)
    s3 = with_timeouts("s3://b/d", {"config_kwargs": {"read_timeout": 99}}, timeouts)
    assert s3["config_kwargs"] == {"read_timeout": 99, "connect_timeout": 3}  # caller's 99 wins
    gs = with_timeouts("gs://b/d", None, timeouts)
    assert (gs["requests_timeout"].sock_connect, gs["requests_timeout"].sock_read) == (3, 7)
    monkeypatch.setenv("FASTDATA_READ_TIMEOUT", "2.5")
    assert Timeouts.from_env() == Timeouts(connect=10, read=2.5, lock=120)
    monkeypatch.setenv("FASTDATA_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FASTDATA_LOCK_TIMEOUT"):
        Timeouts.from_env()


@pytest.mark.parametrize("name", ["ENOLCK", "ENOSYS"])
def test_a_cache_folder_without_flock_says_where_to_put_the_cache(
    tmp_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import errno
    import fcntl

    from fastdata.remote.locks import LockFile, LockUnsupported

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(getattr(errno, name), "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = LockFile(tmp_path / "abc.lock")
    try:
        with pytest.raises(
            LockUnsupported, match=r"without flock.*CacheSettings\(dir=.*local disk"
        ) as err:
            lock.try_lock(fcntl.LOCK_EX)
        assert str(tmp_path) in str(err.value)
        assert isinstance(err.value, RemoteError)  # a reader marks the shard failed, with this text
    finally:
        lock.close()


def test_cache_size_skips_a_file_that_goes_while_it_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank of the node renames its `.part` (or evicts a shard) between the listing and
    the stat: the size counts what is there, it does not raise FileNotFoundError."""
    from fastdata.remote import ShardCache

    cache = ShardCache(tmp_path / "cache", "1MB")
    (cache.cache_dir / "kept.tar").write_bytes(b"x" * 100)
    (cache.cache_dir / "going.tar.100.part").write_bytes(b"y" * 50)
    listing = list(os.scandir(cache.cache_dir))

    def scandir_then_rename(path: object) -> Iterator[os.DirEntry[str]]:
        (cache.cache_dir / "going.tar.100.part").unlink(missing_ok=True)  # after the listing
        return iter(listing)

    monkeypatch.setattr(os, "scandir", scandir_then_rename)
    assert cache.size_bytes() == 100
