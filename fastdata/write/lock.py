"""A lock on an output folder, so that two `fastdata shard` runs never write into one OUT.

The lock is `OUT/.fastdata.lock`, locked with a POSIX record lock (`fcntl.lockf`) and holding
the holder's pid and host. The kernel drops the lock when the holder exits, however it exits, so
a lock left by a killed run is stale by construction: the next run takes it over (and says so,
naming the dead pid). A second run while the first is alive refuses at once, naming the lock
file and the holder's pid, or waits up to `timeout` seconds for it.

Record locks belong to a process, not to a file descriptor: worker processes forked by the
writer do not inherit them (a lingering worker cannot keep a folder locked), and a second lock
of the same folder from the same process is refused by an in-process registry.

Runs of `fastdata shard --part` share the lock (many parts write one folder at once, by design);
a whole run and a merge take it alone.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastdata.write.errors import ShardingError

__all__ = ["LOCK_NAME", "FolderLockedError", "lock_folder"]

log = logging.getLogger("fastdata")
LOCK_NAME = ".fastdata.lock"
_POLL_S = 0.2

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
        # A record lock is the process's: a second holder here would share it, and closing
        # either descriptor would drop both.
        if key in _held:
            raise FolderLockedError(
                f"{path} is held by this process (pid {os.getpid()}): another sharding into "
                f"{folder} is running in it; wait for it to finish or use another output folder"
            )
        _held.add(key)
    try:
        fd = _acquire(path, shared, timeout)
    except BaseException:
        _release_name(key)
        raise
    try:
        yield path
    finally:
        try:
            if _last_holder(fd, shared):
                path.unlink(missing_ok=True)  # before unlocking: no one can lock a removed name
        finally:
            os.close(fd)  # drops the lock
            _release_name(key)


def _last_holder(fd: int, shared: bool) -> bool:
    """True when no other process holds the lock (a shared holder tries to take it alone)."""
    if not shared:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _release_name(key: str) -> None:
    with _held_guard:
        _held.discard(key)


def _acquire(path: Path, shared: bool, timeout: float) -> int:
    """Lock `path` (a file that stays the one under that name) and write our pid into it."""
    deadline = time.monotonic() + timeout
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            previous = _read_holder(fd)
            fcntl.lockf(fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # ENOLCK...: no locks here
                log.warning(
                    "%s: the file system does not support locks (%s); running without the "
                    "lock: make sure no other run writes into %s",
                    path,
                    exc.strerror or exc,
                    path.parent,
                )
                return fd
            os.close(fd)
            if time.monotonic() >= deadline:
                raise FolderLockedError(_busy_message(path, previous, timeout)) from None
            time.sleep(_POLL_S)
            continue
        # The holder we waited for may have removed the name before unlocking: lock the file
        # that is under the name now.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        if previous and not shared:
            log.warning("%s: taking over a stale lock (%s, no longer running)", path, previous)
        if not shared or not previous:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder_text().encode(), 0)
        return fd


def _holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _busy_message(path: Path, holder: str, timeout: float) -> str:
    waited = f" after waiting {timeout:g} s" if timeout > 0 else ""
    return (
        f"{path.parent} is being written by another fastdata run ({holder or 'holder unknown'}, "
        f"lock file {path}){waited}; wait for it to finish, stop it, or choose another output "
        "folder. A lock left by a killed run is taken over automatically."
    )
