"""A lock on an output folder, so that two `fastdata shard` runs never write into one OUT.

The lock is `OUT/.fastdata.lock`, locked with `flock` through the library's one lock primitive
(`fastdata.remote.locks.LockFile`, the shard cache's too) and holding the holder's pid and host.
The kernel drops the lock when the holder exits, however it exits, so a lock left by a killed
run is stale by construction: the next run takes it over (and says so, naming the dead pid). A
second run while the first is alive refuses at once, naming the lock file and the holder's pid,
or waits up to `timeout` seconds for it (`fastdata.remote.locks.wait_for`).

Worker processes forked by the writer do not keep the lock: `LockFile` closes its descriptors in
a forked child (a lingering worker cannot keep a folder locked), and a second lock of the same
folder from the same process is refused by an in-process registry.

Runs of `fastdata shard --part` share the lock (many parts write one folder at once, by design);
a whole run and a merge take it alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastdata.remote.locks import LockFile, LockUnsupported, wait_for
from fastdata.write.errors import ShardingError

__all__ = ["LOCK_NAME", "FolderLockedError", "lock_folder"]

log = logging.getLogger("fastdata")
LOCK_NAME = ".fastdata.lock"

_held: set[str] = set()  # resolved lock paths held by this process
_held_guard = threading.Lock()


class FolderLockedError(ShardingError):
    """Another run holds the output folder's lock."""


@contextmanager
def lock_folder(folder: Path, shared: bool = False, timeout: float = 0.0) -> Iterator[Path]:
    """Hold the lock of `folder` (created if needed) for the `with` block; yields the lock file.

    Args:
        folder: the output folder.
        shared: a shared lock (parts of one sharding); else exclusive.
        timeout: seconds to wait for another holder to finish; 0 refuses at once.

    Raises:
        FolderLockedError: another process (or this one) holds the lock, past `timeout`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    key = str(path.resolve())
    with _held_guard:
        # Two shared holders in one process would not exclude each other (nor an exclusive
        # one a part of this process): one holder per folder and process.
        if key in _held:
            raise FolderLockedError(
                f"{path} is held by this process (pid {os.getpid()}): another sharding into "
                f"{folder} is running in it; wait for it to finish or use another output folder"
            )
        _held.add(key)
    try:
        lock = _acquire(path, shared, timeout)
    except BaseException:
        _release_name(key)
        raise
    try:
        yield path
    finally:
        try:
            if _last_holder(lock, shared):
                path.unlink(missing_ok=True)  # before unlocking: no one can lock a removed name
        finally:
            if lock is not None:
                lock.close()  # drops the lock
            _release_name(key)


def _last_holder(lock: LockFile | None, shared: bool) -> bool:
    """True when no other process holds the lock (a shared holder tries to take it alone; a
    failed try drops its shared lock, flock(2), which is released next anyway)."""
    return not shared or (lock is not None and lock.try_lock(fcntl.LOCK_EX))


def _release_name(key: str) -> None:
    with _held_guard:
        _held.discard(key)


def _acquire(path: Path, shared: bool, timeout: float) -> LockFile | None:
    """Lock `path` (a file that stays the one under that name) and write our pid into it; None
    (after a warning) where the file system has no locks."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    found: dict[str, LockFile | str] = {"previous": ""}

    def attempt() -> bool:
        while True:
            lock = LockFile(path)
            found["previous"] = _read_holder(lock)
            try:
                taken = lock.try_lock(mode)
            except BaseException:
                lock.close()
                raise
            if not taken:
                lock.close()
                return False
            if _still_named(lock, path):
                found["lock"] = lock
                return True
            # The holder we waited for removed the name before unlocking: lock the file that
            # is under the name now (at once: that holder is gone, this is no wait).
            lock.close()

    def busy() -> FolderLockedError:
        return FolderLockedError(_busy_message(path, str(found["previous"]), timeout))

    try:
        wait_for(attempt, timeout, busy)
    except LockUnsupported as exc:
        cause = exc.__cause__
        log.warning(
            "%s: the file system does not support locks (%s); running without the "
            "lock: make sure no other run writes into %s",
            path,
            getattr(cause, "strerror", None) or cause or exc,
            path.parent,
        )
        return None
    lock, previous = found["lock"], str(found["previous"])
    assert isinstance(lock, LockFile)
    if previous and not shared:
        log.warning("%s: taking over a stale lock (%s, no longer running)", path, previous)
    if not shared or not previous:
        os.ftruncate(lock.fileno(), 0)
        os.pwrite(lock.fileno(), _holder_text().encode(), 0)
    return lock


def _still_named(lock: LockFile, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(lock.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _read_holder(lock: LockFile) -> str:
    try:
        return os.pread(lock.fileno(), 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _busy_message(path: Path, holder: str, timeout: float) -> str:
    waited = f" after waiting {timeout:g} s" if timeout > 0 else ""
    return (
        f"{path.parent} is being written by another fastdata run ({holder or 'holder unknown'}, "
        f"lock file {path}){waited}; wait for it to finish, stop it, or choose another output "
        "folder. A lock left by a killed run is taken over automatically."
    )
