"""Threads: small CPU tensor work on one thread (`one_thread_on_cpu`); the decode pool (`process_pool`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

__all__ = ["one_thread_on_cpu", "process_pool"]


@contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Limit torch to one intra-op thread for the block when `device` is the CPU.

    Batch gathers and augmentation are small, memory-bound ops: with torch's intra-op threads,
    any other busy process on the machine makes the threads wait on each other. Measured on
    2 cores with one busy, the CIFAR augmentation of a 256 batch ran 25x slower with 2 threads
    than with 1 (4,000 vs 100,000 img/s). Switching the thread count costs ~2 us, and the model's
    own ops outside the block keep their threads.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# This process's thread pool (decoding: `fastdata.read.decoders.image.decode_batch`). A forked child (a
# DataLoader worker) inherits the parent's pool but not its threads, so it starts a new one, and
# it keeps the inherited object alive: nothing may wait for threads that do not exist in the child.

_state_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (threads, pool)
_inherited: list[object] = []


def _forget_parent_pool() -> None:
    global _state_lock, _pool
    _inherited.append(_pool)
    _state_lock, _pool = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_parent_pool)


def process_pool(threads: int) -> ThreadPoolExecutor:
    """This process's thread pool, with at least `threads` threads (created on first use)."""
    global _pool
    with _state_lock:
        if _pool is None or _pool[0] < threads:
            # A smaller pool is dropped, not shut down: a batch in another thread may still be
            # submitting to it; its idle threads exit once nothing references it.
            _pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="fastdata-decode"))
        return _pool[1]
