"""DataLoader workers that never outlive the training process.

`worker_init` (each worker's `worker_init_fn`) asks Linux to SIGKILL the worker when its parent
dies (`prctl(PR_SET_PDEATHSIG)`), and starts a watchdog thread (every platform) that ends the
worker within `_PARENT_POLL_S` of the parent's (or, under "forkserver", the training process's)
death, whatever the worker's other threads are blocked on (a stalled read, a decode).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

__all__ = ["worker_init"]

log = logging.getLogger("fastdata")

_PARENT_POLL_S = 0.5  # how often a worker's watchdog looks for its parent
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def worker_init(main_pid: int, death_signal: bool, worker_id: int) -> None:
    """DataLoader worker start: end this worker when its parent (or `main_pid`) dies.

    Args:
        main_pid: the training process (the parent, except under "forkserver").
        death_signal: ask Linux for SIGKILL at the parent's death (only when the main thread
            started the worker: the signal follows the starting thread, not the process).
        worker_id: the worker's number (DataLoader's argument).
    """
    parent = os.getppid()
    if death_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.debug("worker %d: prctl(PR_SET_PDEATHSIG) failed", worker_id)
    watchdog = threading.Thread(
        target=_watch_parent, args=(parent, main_pid), name="fastdata-parent-watch", daemon=True
    )
    watchdog.start()
    if not _parents_alive(parent, main_pid):  # died before the signal was asked for
        os._exit(1)


def _watch_parent(parent: int, main_pid: int) -> None:
    """Poll until the parent or the training process is gone, then end this process at once."""
    while _parents_alive(parent, main_pid):
        time.sleep(_PARENT_POLL_S)
    os._exit(1)  # ends the process whatever its other threads are blocked on


def _parents_alive(parent: int, main_pid: int) -> bool:
    if os.getppid() != parent:  # re-parented: the parent died
        return False
    if main_pid == parent or os.name != "posix":
        return True
    try:
        os.kill(main_pid, 0)  # POSIX: a probe, no signal sent
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
