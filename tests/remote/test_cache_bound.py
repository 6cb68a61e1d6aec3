"""`cache_limit` is a limit: two ranks of one node (two processes sharing a cache folder, as
torchrun's LOCAL_WORLD_SIZE=2 says), each a `ShardDataModule` with 2 loader workers, read a
dataset over HTTP while this process samples the folder's size. At and above what the readers
pin (`check_cache_room`'s need) the folder never holds more than the limit plus one shard, and
is back within the limit after `teardown()`; below it, `setup()` refuses with the size to set.

Run with `-s` to see the peaks against the limits."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdata import CacheSettings, ShardDataModule, WorkerSettings
from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.read.shardio import ShardReader, pins_needed
from fastdata.remote import ShardCache
from fastdata.remote.locks import LockFile
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source
from tests.remote.conftest import FAST_RETRY
from tests.remote.readers import folder_bytes
from tests.remote.servers import FileServer

RANKS, WORKERS, SAMPLES = 2, 2, 400
#: Readers of the node: ranks x workers x 2 (a persistent worker reads the next epoch's first
#: batch ahead through a second reader), each pinning `pins_needed` shards.
READERS = RANKS * WORKERS * 2


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """40 train shards of 10 8x8 samples (~37 kB each), served over HTTP."""
    out = tmp_path_factory.mktemp("many-shards")
    source = unique_label_source(n_train=SAMPLES, n_test=10)
    write_shards(source, out, ShardOptions(max_count=10, workers=1, progress=False))
    server = FileServer(out)
    yield server.url
    server.stop()


def shard_size(manifest: Manifest) -> int:
    """The biggest train shard with its index (what one pin holds in the folder)."""
    shards = manifest.split("train").shards
    return max(s.bytes + 128 * s.num_samples for s in shards)


def need_of(manifest: Manifest) -> int:
    return READERS * pins_needed(manifest) * shard_size(manifest)


def module(url: str, cache_dir: Path, limit: int, rank: int = 0) -> ShardDataModule:
    return ShardDataModule(
        url,
        batch_size=10,
        backend="cpu",
        rank=rank,
        world_size=RANKS,
        workers=WorkerSettings(num_workers=WORKERS, prefetch_factor=2),
        cache=CacheSettings(dir=str(cache_dir), limit=limit),
    )


def rank_main(results: multiprocessing.Queue, url: str, runs: list[tuple[str, int]], rank: int):
    """One rank: a training epoch per (cache folder, limit), torn down after each."""
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS)
    try:
        for cache_dir, limit in runs:
            dm = module(url, Path(cache_dir), limit, rank)
            dm.setup("fit")
            labels = [y for _, batch in dm.train_dataloader() for y in batch.tolist()]
            dm.teardown("fit")
            results.put((rank, cache_dir, labels))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


class Sampler:
    """The peak size of each folder, sampled every few milliseconds in a thread."""

    def __init__(self, folders: list[Path]) -> None:
        self.peaks = dict.fromkeys(folders, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):  # a shard's download takes longer than this
            for folder in self.peaks:
                try:
                    self.peaks[folder] = max(self.peaks[folder], folder_bytes(folder))
                except FileNotFoundError:  # a file went between listing and stat
                    continue

    def stop(self) -> dict[Path, int]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.peaks


def test_limit_below_the_readers_need_is_refused_at_setup(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(RANKS))
    need = need_of(load_manifest(served))
    dm = module(served, tmp_path / "cache", need - 1)
    with pytest.raises(ValueError, match=f"at least {need:,}") as info:
        dm.setup("fit")
    print(f"\nlimit {need - 1:,} bytes, readers' need {need:,}: refused at setup()")
    assert str(tmp_path / "cache") in str(info.value) and "loader workers" in str(info.value)
    module(served, tmp_path / "cache", need).setup("fit")  # exactly the need is enough


@pytest.mark.slow
def test_two_ranks_with_workers_stay_within_the_limit(served: str, tmp_path: Path) -> None:
    manifest = load_manifest(served)
    need, shard = need_of(manifest), shard_size(manifest)
    total = sum(s.bytes + 128 * s.num_samples for s in manifest.split("train").shards)
    assert need < total / 2, "the dataset must be far bigger than the limits tested"
    limits = {tmp_path / "at": need, tmp_path / "above": need * 3 // 2}
    for folder in limits:
        folder.mkdir()
    runs = [(str(folder), limit) for folder, limit in limits.items()]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(results, served, runs, r)) for r in range(2)]
    sampler = Sampler(list(limits))
    started = time.monotonic()
    for process in ranks:
        process.start()
    try:
        got = [results.get(timeout=240) for _ in range(RANKS * len(runs))]
        print(f"\nranks done in {time.monotonic() - started:.1f} s")
    except queue.Empty:
        pytest.fail("a rank did not end within 240 s")
    finally:
        peaks = sampler.stop()
        for process in ranks:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
    errors = [message for _, where, message in got if where == "error"]
    assert not errors, errors
    print(f"\nreaders' need {need:,} bytes, one shard {shard:,}, train split {total:,}")
    for folder, limit in limits.items():
        labels = [y for _, where, batch in got if where == str(folder) for y in batch]
        assert set(labels) == set(range(SAMPLES)), f"{folder.name}: samples lost"
        after = folder_bytes(folder)
        print(
            f"limit {folder.name} the need: {limit:,} bytes; peak {peaks[folder]:,} "
            f"({peaks[folder] / limit:.2f}x the limit); after teardown {after:,}"
        )
        assert peaks[folder] <= limit + shard, f"{folder.name}: over the limit by over a shard"
        assert after <= limit, f"{folder.name}: still over the limit after teardown()"


def test_a_remote_reader_pins_at_most_two_shards(served: str, tmp_path: Path) -> None:
    manifest = load_manifest(served)
    cache = ShardCache(tmp_path / "cache", "1GB", retry=FAST_RETRY)
    reader = ShardReader(manifest, "train", cache=cache)  # max_open=8 for local shards
    try:
        for number in range(6):
            reader.sample(number, 0)
            pinned = sum(entry[2] is not None for entry in reader._open.values())
            assert pinned <= pins_needed(manifest) == 2, f"{pinned} shards pinned"
    finally:
        reader.close()


def test_a_split_smaller_than_the_readers_need_needs_only_its_size(
    http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers cannot pin more than the shards there are: 5 train shards need only their sum."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(RANKS))
    shards = load_manifest(http_server.url).split("train").shards
    whole = sum(s.bytes + 128 * s.num_samples for s in shards)
    module(http_server.url, tmp_path / "cache", whole).setup("fit")
    with pytest.raises(ValueError, match=f"every shard they read, {whole:,} bytes"):
        module(http_server.url, tmp_path / "cache", whole - 1).setup("fit")


def test_a_read_waits_for_a_prefetch_under_way_instead_of_going_over(
    dataset: Path, http_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard a pinned and b being prefetched fill the limit: the read of c waits for b to
    finish (then evicts it) rather than downloading c over the limit."""
    manifest = load_manifest(http_server.url)
    a, b, c = manifest.split("train").shards[:3]
    on_disk = {s.name: s.bytes + (dataset / s.index).stat().st_size for s in (a, b, c)}
    limit = on_disk[a.name] + on_disk[c.name] + 1000  # no room for b beside them
    cache = ShardCache(tmp_path / "cache", limit, retry=FAST_RETRY)
    pin_a = cache.acquire(manifest, a)
    # A prefetch of b under way, as another process's prefetch thread makes it.
    lock = LockFile(cache.cache_dir / f"{b.sha256}.lock")
    assert lock.try_lock(fcntl.LOCK_EX)
    part = cache.cache_dir / f"{b.sha256}.tar.{b.bytes}.ahead.part"
    part.write_bytes((dataset / b.name).read_bytes())

    def finish() -> None:
        time.sleep(0.5)
        os.replace(part, cache.cache_dir / f"{b.sha256}.tar")
        lock.close()

    prefetch = threading.Thread(target=finish)
    prefetch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="fastdata"):
            pin_c = cache.acquire(manifest, c)
    finally:
        prefetch.join()
    assert not (cache.cache_dir / f"{b.sha256}.tar").exists(), "b was not evicted for c"
    assert cache.size_bytes() <= limit, f"{cache.size_bytes()} bytes over the limit {limit}"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    pin_a.release()
    pin_c.release()
