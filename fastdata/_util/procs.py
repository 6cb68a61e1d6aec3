"""Worker processes that cannot hang their parent: `run_in_processes`.

`multiprocessing.Pool` ends its workers with SIGTERM and then joins them without a bound. A worker
forked from a process that has a Python SIGTERM handler (pytest-xdist's workers, Lightning's
training loop, job wrappers) inherits the handler, survives the signal, and the join never
returns; a worker that dies mid-task (the OOM killer) leaves its task's result missing and the
pool waiting forever; and a parent killed outright leaves its workers blocked on the task queue.
Measured (issue 36): with a recording SIGTERM handler and one running thread, `write_shards` and
`index_shards` with 2 workers each hung within their first 5 runs.

Here, instead:

- a worker starts with SIGTERM at its default action and SIGINT ignored (the parent handles
  Ctrl-C and ends the workers), with those signals blocked from before the fork until the
  defaults are in place, so no inherited handler ever runs in it;
- a worker asks the kernel to SIGKILL it when its parent dies (Linux `PR_SET_PDEATHSIG`), and
  leaves at once if the parent died before that was set;
- each worker has its own pipe (no queue lock shared between workers), and the parent waits on
  the pipes and the processes together: a worker that dies mid-task raises `WorkerDiedError`
  naming the task, it is never waited for;
- on success workers are told to leave and joined with a bound; on failure or early exit they
  are terminated, joined with a bound, then killed (SIGKILL cannot be caught).

Start method: `fork` on Linux (the source's arrays shared copy-on-write, and a user's script
needs no `if __name__ == "__main__":` guard, as with `multiprocessing.Pool` before), `spawn`
elsewhere. A fork server was measured and not taken: in a script without that guard its workers
re-run the script and fail (what `DataLoader` users meet on Python 3.14), and it pickles the
source to every worker. A fork from a process running other threads is safe here as far as
Python's own locks go (CPython re-creates the import and logging locks in the child, and the
decode pool's threads are forgotten: `fastdata._util.threads`); the worker runs only the task.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

__all__ = ["WorkerDiedError", "choose_start_method", "run_in_processes"]

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")

#: How long a worker told to leave, or terminated, is waited for before the next step.
JOIN_SECONDS = 10.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


class WorkerDiedError(RuntimeError):
    """A worker process ended before it returned its task's result (killed, out of memory)."""


def choose_start_method() -> str:
    """`fork` on Linux, `spawn` elsewhere (see the module's docstring)."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


def run_in_processes(
    fn: Callable[[S, T], R],
    shared: S,
    tasks: Sequence[T],
    workers: int,
    *,
    start_method: str | None = None,
    describe: Callable[[T], str] = repr,
) -> Iterator[tuple[int, R]]:
    """Call ``fn(shared, task)`` for every task in `workers` processes; yield ``(index, result)``
    in the order the tasks finish.

    Args:
        fn: a module-level function (it is pickled under `forkserver`/`spawn`).
        shared: sent once to each worker (inherited, not copied, under `fork`).
        tasks: picklable tasks, each sent to the next idle worker.
        workers: how many processes (at most one per task).
        start_method: `fork`, `forkserver` or `spawn`; None: `choose_start_method()`.
        describe: names a task in errors (`WorkerDiedError`).

    Raises:
        Exception: the first exception a task raised (re-raised here, with the worker's
            traceback as its `__cause__`); the other workers are ended first.
        WorkerDiedError: a worker ended without returning its task's result.
    """
    context = mp.get_context(start_method or choose_start_method())
    procs: list[tuple[Any, Connection]] = []
    try:
        for _ in range(max(1, min(workers, len(tasks)))):
            procs.append(_start(context, fn, shared))
        yield from _dispatch(procs, tasks, describe)
        _stop(procs, graceful=True)
    finally:
        _stop(procs, graceful=False)  # after an error or an early exit; nothing left on success


def _dispatch(
    procs: list[tuple[Any, Connection]], tasks: Sequence[T], describe: Callable[[T], str]
) -> Iterator[tuple[int, Any]]:
    pending = iter(enumerate(tasks))
    running: dict[Connection, int] = {}  # a worker's pipe -> the task index it runs
    proc_of = {conn: proc for proc, conn in procs}
    conn_of = {proc.sentinel: conn for proc, conn in procs}
    for _proc, conn in procs:
        if not _send_next(conn, pending, running):
            break
    while running:
        ready = wait([*running, *(p.sentinel for p, c in procs if c in running)], timeout=1.0)
        for item in ready:
            conn = item if isinstance(item, Connection) else conn_of[item]
            if conn not in running:
                continue
            index = running[conn]
            task = tasks[index]
            if not conn.poll():  # the process ended and left nothing to read
                raise _died(proc_of[conn], describe(task))
            try:
                status, value, text = conn.recv()
            except (EOFError, OSError) as exc:  # ended before or while it replied
                raise _died(proc_of[conn], describe(task)) from exc
            except Exception as exc:  # noqa: BLE001 - a reply that does not unpickle here
                raise RuntimeError(f"task {describe(task)}: its reply could not be read") from exc
            del running[conn]
            if status == "error":
                if value is None:
                    raise RuntimeError(f"task {describe(task)} failed:\n{text}")
                raise value from _RemoteTraceback(text)
            yield index, value
            try:
                _send_next(conn, pending, running)
            except OSError as exc:  # it ended after its reply, before this task reached it
                raise _died(proc_of[conn], describe(tasks[running[conn]])) from exc


def _send_next(conn: Connection, pending: Iterator[tuple[int, Any]], running: dict) -> bool:
    item = next(pending, None)
    if item is None:
        return False
    running[conn] = item[0]  # before the send: a failed send names this task
    conn.send(item)
    return True


def _died(proc: Any, task: str) -> WorkerDiedError:
    proc.join(JOIN_SECONDS)  # it has ended (EOF or its sentinel): the join only reaps it
    return WorkerDiedError(
        f"worker process {proc.pid} running task {task} ended without a result "
        f"({_exit_text(proc.exitcode)}); if the machine ran out of memory, use fewer workers"
    )


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"killed by {name}"
    return f"exit code {code}"


def _start(context: Any, fn: Callable, shared: Any) -> tuple[Any, Connection]:
    parent_end, child_end = context.Pipe()
    forked = context.get_start_method() == "fork"
    # Forked, the child inherits the parent's end too: it closes it (or the parent's death shows
    # as no EOF there), and checks that its parent is the one that forked it.
    inherited = (parent_end, os.getpid()) if forked else None
    proc = context.Process(target=_worker, args=(fn, shared, child_end, inherited), daemon=True)
    # Blocked across the fork, so that an inherited Python handler never runs in the child
    # (the child unblocks them once SIGTERM/SIGINT have their defaults there).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    child_end.close()
    return proc, parent_end


def _worker(
    fn: Callable, shared: Any, conn: Connection, inherited: tuple[Connection, int] | None
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    if inherited is not None:
        parent_end, parent_pid = inherited
        parent_end.close()
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent died before PDEATHSIG was set
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        index, task = item
        try:
            reply: tuple[Any, ...] = ("ok", fn(shared, task), "")
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
            text = "".join(traceback.format_exception(exc))
            # An exception that pickles but does not rebuild (an __init__ of several arguments)
            # would reach the parent as an unrelated TypeError: send its text alone then.
            reply = ("error", exc if _round_trips(exc) else None, text)
        try:
            conn.send(reply)
        except Exception as exc:  # the result does not pickle
            text = reply[2] or "".join(traceback.format_exception(exc))
            conn.send(("error", None, text))


def _round_trips(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to pickle or to rebuild
        return False
    return True


class _RemoteTraceback(Exception):
    """The worker's traceback, attached to the re-raised exception as its `__cause__`."""

    def __str__(self) -> str:
        return f"in the worker process:\n{self.args[0]}"


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the EOF on the pipe still ends an idle worker
        pass


def _stop(procs: list[tuple[Any, Connection]], *, graceful: bool) -> None:
    """End the workers: asked to leave (graceful), else terminated; then bounded joins, killed
    when a join times out. Empties `procs`."""
    for proc, conn in procs:
        if graceful:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        elif proc.is_alive():
            proc.terminate()
    for proc, conn in procs:
        proc.join(JOIN_SECONDS)
        if proc.is_alive():
            proc.kill()  # SIGKILL: cannot be caught or ignored
            proc.join(JOIN_SECONDS)
        conn.close()
    procs.clear()
