"""File locks that never wait for ever and never outlive a fork: the shard cache's and the
shard writer's (`fastdata.write.lock`, an output folder's lock), one primitive for both.

`fcntl.flock` locks belong to an *open file description*, which `fork` shares with the child:
a lock held by any thread of a process at the moment it forks (a DataLoader starting its
workers while the prefetch thread downloads) stays held until the parent *and* every child have
closed their copy, and the child has no code that ever will. So:

- every lock file is opened through `LockFile`, which keeps a registry of the descriptors this
  process holds; `os.register_at_fork` closes all of them in a new child (and marks the objects
  dead there, so a later `close()` in the child cannot close an unrelated reused descriptor);
- the registry's mutex is taken around the fork, so no descriptor is half-registered then;
- nothing waits on a lock with a blocking `flock`: `wait_for` (and `LockFile.wait`, the cache's
  form of it) polls `LOCK_NB` until a deadline, which a caller may push back while the holder
  visibly makes progress (a download growing), and then raises the caller's error (the cache's:
  `LockTimeout`, naming the lock file, what it guards and the pids holding it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fastdata.remote.retry import RemoteError

__all__ = ["LockFile", "LockTimeout", "LockUnsupported", "holders", "wait_for"]

_POLL_FIRST, _POLL_MAX = 0.002, 0.1  # seconds between two tries: doubling up to 0.1 s

_registry_mutex = threading.RLock()  # reentrant: a __del__ may run inside a locked block
_open: dict[int, LockFile] = {}  # fd -> its LockFile, in this process


class LockTimeout(RemoteError):
    """A cache lock stayed taken past its deadline (another process holds it and makes no
    progress). The message names the lock file, what it guards and the processes holding it."""


class LockUnsupported(RemoteError):
    """The cache folder's file system refuses `flock` (the message says where to put it)."""


#: errnos of a file system that has no flock at all (as opposed to a lock held by someone else).
_NO_LOCKS = frozenset(
    getattr(errno, name)
    for name in ("ENOLCK", "ENOSYS", "EOPNOTSUPP", "ENOTSUP")
    if hasattr(errno, name)
)


class LockFile:
    """One open descriptor of a lock file; `try_lock`/`wait` take `flock` locks on it.

    Closing it (`close`, or garbage collection) releases its lock. A forked child finds every
    LockFile of its parent already closed (see the module docstring).

    Args:
        path: the lock file (created if missing; never deleted: deleting lock files races).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.mode = 0  # 0, fcntl.LOCK_SH or fcntl.LOCK_EX: what this descriptor holds
        with _registry_mutex:
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            _open[self._fd] = self

    def try_lock(self, mode: int) -> bool:
        """Take (or convert to) `mode` without waiting; False when another descriptor has a
        conflicting lock. A conversion is not atomic (flock(2)): a failed one holds nothing."""
        if self._fd is None:
            raise ValueError(f"lock file {self.path} is closed")
        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                raise LockUnsupported(
                    str(self.path),
                    f"the shard cache's folder {self.path.parent} is on a file system without "
                    f"flock ({exc.strerror}: NFS without lockd, Lustre without -o flock, ...), "
                    "so ranks and workers cannot share it safely",
                    "Set cache=CacheSettings(dir=...) (or $FASTDATA_CACHE_DIR) to a folder on a local disk",
                ) from exc
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if self.mode and self.mode != mode:
                self.mode = 0  # flock(2) drops the old lock before it fails to take the new one
            return False
        self.mode = mode
        return True

    def unlock(self) -> None:
        """Release the lock, keep the descriptor."""
        if self._fd is not None and self.mode:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.mode = 0

    def wait(
        self,
        attempt: Callable[[], bool],
        timeout: float,
        what: str,
        progress: Callable[[], object] | None = None,
    ) -> None:
        """Call `attempt` (which tries locks on this file) until it returns True.

        Args:
            attempt: one non-blocking try; True ends the wait.
            timeout: seconds without progress after which to give up.
            what: what the lock guards, for the error (e.g. the shard and its URL).
            progress: a token of the holder's progress (e.g. the size of its download); each
                change restarts the timeout.

        Raises:
            LockTimeout: `timeout` seconds passed without the lock and without progress.
        """

        def timed_out() -> LockTimeout:
            pids = holders(self.path)
            return LockTimeout(
                what,
                f"waited {timeout:g} s for the cache lock {self.path}, held by "
                f"{'process ' + ', '.join(map(str, pids)) if pids else 'another process'} "
                "without progress",
                "A process of this node holds the lock and is stuck or stopped: end it, or "
                "give this job its own cache_dir; raise lock_timeout for a slow store.",
            )

        wait_for(attempt, timeout, timed_out, progress)

    def fileno(self) -> int:
        """The open descriptor (e.g. to write the holder's name into the file)."""
        if self._fd is None:
            raise ValueError(f"lock file {self.path} is closed")
        return self._fd

    def close(self) -> None:
        """Release the lock and close the descriptor. Safe to call twice, and in a child."""
        with _registry_mutex:
            fd, self._fd, self.mode = self._fd, None, 0
            if fd is not None and _open.get(fd) is self:
                del _open[fd]
                os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __del__(self) -> None:
        self.close()


def wait_for(
    attempt: Callable[[], bool],
    timeout: float,
    timed_out: Callable[[], BaseException],
    progress: Callable[[], object] | None = None,
) -> None:
    """Call `attempt` (a non-blocking try) until it returns True, for at most `timeout` seconds.

    Tries come 2 ms apart at first, doubling up to 0.1 s; with ``timeout=0`` `attempt` runs
    once.

    Args:
        attempt: one non-blocking try; True ends the wait.
        timeout: seconds without progress after which to give up.
        timed_out: the error to raise then (made when it is raised: it may name the holder).
        progress: a token of the holder's progress; each change restarts the timeout.

    Raises:
        BaseException: `timed_out()`, when `timeout` seconds passed without the lock and
            without progress.
    """
    deadline = time.monotonic() + timeout
    mark = progress() if progress else None
    pause = _POLL_FIRST
    while not attempt():
        now = time.monotonic()
        if progress is not None and (token := progress()) != mark:
            mark, deadline = token, now + timeout
        if now >= deadline:
            raise timed_out()
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def holders(path: Path) -> list[int]:
    """Pids that hold a flock on `path` according to /proc/locks (empty where unreadable)."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter ("1: -> FLOCK ..."), not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
            pids.append(int(fields[4]))
    return sorted(set(pids))


def _before_fork() -> None:
    _registry_mutex.acquire()


def _after_fork_in_parent() -> None:
    _registry_mutex.release()


def _after_fork_in_child() -> None:
    """Close every inherited lock descriptor: the parent's locks are the parent's alone."""
    global _registry_mutex
    for fd, lock in list(_open.items()):
        lock._fd, lock.mode = None, 0
        try:
            os.close(fd)
        except OSError:
            pass
    _open.clear()
    _registry_mutex = threading.RLock()  # the parent's was held across the fork


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
