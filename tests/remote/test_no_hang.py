"""Remote reads never wait for ever: locks across forks, stalled servers, failing shards."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.remote import RetryPolicy, ShardCache
from fastdata.remote.config import Timeouts
from fastdata.remote.locks import LockTimeout
from tests.remote.conftest import FAST_RETRY
from tests.remote.servers import FaultPlan, FaultProxy, FileServer

REPO = Path(__file__).resolve().parents[2]


def bounded(fn: Callable[[], Any], timeout: float) -> tuple[Any, BaseException | None, float]:
    """Run `fn` in a daemon thread: (result, error, seconds); fails the test if it is still
    running after `timeout` (so that a hang on old code fails instead of hanging the test)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still waiting after {timeout} s"
    return out.get("result"), out.get("error"), time.monotonic() - start


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


FORK_WHILE_LOCKED = """
    import multiprocessing, sys, threading
    import fastdata.remote.cache as cache_module
    from fastdata.format.manifest_io import load_manifest
    from fastdata.remote import ShardCache

    url, cache_dir = sys.argv[1:3]
    manifest = load_manifest(url)
    shard = manifest.split("train").shards[0]
    cache = ShardCache(cache_dir, "10MB")
    downloading, go = threading.Event(), threading.Event()
    real_download = cache_module.download

    def held_download(*args, **kwargs):  # the shard's lock is held while this runs
        downloading.set()
        go.wait(30)
        return real_download(*args, **kwargs)

    cache_module.download = held_download
    # The main process's prefetch thread, downloading while the DataLoader forks its workers.
    prefetch = threading.Thread(target=cache.fetch, args=(manifest, shard), daemon=True)
    prefetch.start()
    assert downloading.wait(30)

    def worker(results):
        with cache.acquire(manifest, shard) as pinned:
            results.put(pinned.tar.stat().st_size)

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=worker, args=(results,))
    child.start()  # forks while the prefetch thread holds the shard's lock
    go.set()
    prefetch.join(30)
    child.join(20)
    if child.is_alive():
        child.kill()
        print("HUNG: the forked worker still waits for the shard lock")
        sys.exit(1)
    print("OK", results.get(timeout=5) == shard.bytes, child.exitcode)
"""


def test_a_lock_held_across_a_fork_does_not_block_the_child(
    http_server: FileServer, tmp_path: Path
) -> None:
    done = run_script(FORK_WHILE_LOCKED, http_server.url, str(tmp_path / "cache"))
    assert done.stdout.strip() == "OK True 0", done.stdout + done.stderr


def test_a_lock_held_for_ever_raises_naming_the_lock_file(
    http_server: FileServer, tmp_path: Path
) -> None:
    manifest = load_manifest(http_server.url)
    shard = manifest.split("train").shards[0]
    cache = ShardCache(tmp_path / "cache", "10MB", timeouts=Timeouts(lock=1.0))
    lock_file = cache.cache_dir / f"{shard.sha256}.lock"
    holder = subprocess.Popen(  # a process that took the lock and is stuck
        [sys.executable, "-c", HOLD_LOCK, str(lock_file)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        _, error, seconds = bounded(lambda: cache.acquire(manifest, shard), timeout=30)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert isinstance(error, LockTimeout), error
    message = str(error)
    assert str(lock_file) in message and f"{http_server.url}/{shard.name}" in message
    assert str(holder.pid) in message  # the pid holding it, from /proc/locks
    assert seconds < 10
    # Once the holder is gone, the same cache reads the shard.
    assert cache.fetch(manifest, shard).stat().st_size == shard.bytes


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


def test_a_server_that_never_answers_fails_within_the_timeout(
    http_server: FileServer, tmp_path: Path
) -> None:
    proxy = FaultProxy(http_server.url, FaultPlan(stall=True))  # shard GETs hang
    try:
        manifest = load_manifest(proxy.url)
        retry = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01)
        timeouts = Timeouts(connect=1.0, read=1.0)
        cache = ShardCache(tmp_path / "cache", "10MB", retry=retry, timeouts=timeouts)
        reader = ShardReader(manifest, "train", cache=cache)
        _, error, seconds = bounded(lambda: reader.sample(0, 0), timeout=60)
    finally:
        proxy.stop()
    assert isinstance(error, ShardReadError), error
    assert f"{proxy.url}/train-000000.tar" in str(error)
    assert "failed 2 times" in str(error) and "Timeout" in str(error)
    assert seconds < 15  # two tries of a 1 s read timeout, not aiohttp's 5 minutes
    assert proxy.gets["/train-000000.tar"] == 2


def test_a_failing_shard_is_skipped_whole_once_per_epoch(
    http_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = "/train-000001.tar"
    proxy = FaultProxy(http_server.url, FaultPlan(fail_paths=frozenset({bad})))
    try:
        manifest = load_manifest(proxy.url)
        shard = manifest.split("train").shards[1]
        cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
        spec = LoaderSpec(
            manifest, "train", train=True, batch_size=32, seed=1, on_error="skip", cache=cache
        )
        loader = make_cpu_loader(spec)
        with caplog.at_level(logging.WARNING, logger="fastdata"):
            labels, _, seconds = bounded(
                lambda: [y for _, batch in loader for y in batch.tolist()], timeout=60
            )
    finally:
        proxy.stop()
    assert labels is not None and len(labels) == 300 - shard.num_samples
    assert loader.skipped == shard.num_samples
    assert proxy.gets[bad] == FAST_RETRY.attempts  # one round of tries, not one per sample
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert shard.name in warnings[0] and f"{proxy.url}{bad}" in warnings[0]
    assert "503" in warnings[0]
    assert seconds < 30


KILLED_MID_EPOCH = """
    import os, sys, time
    from pathlib import Path
    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.base import LoaderSpec, WorkerSettings
    from fastdata.read.backends.cpu import make_cpu_loader
    from fastdata.read.shardio import ShardReader
    from fastdata.remote import RetryPolicy, ShardCache

    url, cache_dir = sys.argv[1:3]
    manifest = load_manifest(url)
    retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)
    cache = ShardCache(cache_dir, "10MB", retry=retry)
    workers = WorkerSettings(num_workers=2, prefetch_factor=2, persistent_workers=True)
    spec = LoaderSpec(manifest, "train", train=True, batch_size=16, seed=2, cache=cache,
                      workers=workers)
    # The main process reads ahead, as the loader tuner does: its prefetch thread is
    # downloading (holding a shard's lock) when the DataLoader forks its workers.
    ShardReader(manifest, "train", cache=cache).prefetch(range(5), ahead=2)
    deadline = time.monotonic() + 30
    while not list(Path(cache_dir).glob("*.tar.*.part")) and time.monotonic() < deadline:
        time.sleep(0.01)
    loader = make_cpu_loader(spec)
    batches = iter(loader.dataloader)
    print("workers", *[w.pid for w in batches._workers], flush=True)
    for _ in range(len(loader) - 1):  # every shard is reached (the fifth one, too)
        next(batches)
    print("batch", flush=True)
    input()  # mid-epoch, before the last batch: killed here by the test
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_killing_the_main_process_mid_epoch_leaves_no_worker(
    http_server: FileServer, tmp_path: Path
) -> None:
    proxy = FaultProxy(
        http_server.url, FaultPlan(delay=1.0)
    )  # a slow store: the fork meets a download
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    main = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_EPOCH), proxy.url, str(tmp_path / "c")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    lines: list[str] = []
    reading = threading.Thread(target=lambda: lines.extend(main.stdout), daemon=True)  # type: ignore[arg-type]
    reading.start()
    try:
        deadline = time.monotonic() + 60
        while "batch\n" not in lines and time.monotonic() < deadline and main.poll() is None:
            time.sleep(0.05)
        workers = [int(pid) for pid in lines[0].split()[1:]] if lines else []
        main.kill()  # SIGKILL: no clean-up of any kind in the main process
        main.wait(timeout=10)
        assert len(workers) == 2, lines
        assert "batch\n" in lines, f"no batch within 60 s: {lines}"
        deadline = time.monotonic() + 15
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [pid for pid in workers if _alive(pid)]
    finally:
        main.kill()
        for pid in [int(p) for p in lines[0].split()[1:]] if lines else []:
            if _alive(pid):
                os.kill(pid, 9)
        proxy.stop()
    assert not alive, f"workers {alive} outlived their main process by 15 s"
