"""Remote shards over Python's HTTP server, through the node-local cache, with injected faults."""

from __future__ import annotations

import multiprocessing
import pickle
import time
from pathlib import Path

import pytest

from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.remote import ShardCache
from tests.remote.conftest import FAST_RETRY
from tests.remote.readers import folder_bytes, plan_shard_order, rank_main, read_epoch
from tests.remote.servers import FaultPlan, FaultProxy, FileServer


def local_digests(manifest: Manifest, split: str) -> dict[str, str]:
    """The same digests read from the local folder: what an intact remote read must give."""
    order = list(range(len(manifest.split(split).shards)))
    seen, _ = read_epoch(manifest, split, None, order)  # a local manifest needs no cache
    return seen


def test_one_epoch_over_faulty_http_is_exact_and_bounded(
    faulty_http: FaultProxy, local_manifest: Manifest, tmp_path: Path
) -> None:
    manifest = load_manifest(faulty_http.url)
    shards = manifest.split("train").shards
    biggest = max(s.bytes for s in shards)
    limit = 2 * biggest + biggest // 2  # 2.5 shards of 5: eviction must happen
    cache = ShardCache(tmp_path / "cache", limit, retry=FAST_RETRY)
    order = plan_shard_order(manifest, "train", seed=3)
    assert order != sorted(order)  # a real plan order, not file order

    seen, sizes = read_epoch(manifest, "train", cache, order, prefetch=2)

    # Every sample once, each byte-identical to the local copy: no corrupt sample delivered.
    assert seen == local_digests(local_manifest, "train")
    assert len(seen) == 300
    # The cache never exceeds its limit plus one shard (measured after each shard open).
    assert max(sizes) <= limit + biggest, (sizes, limit)
    assert cache.stats.evictions > 0
    # Each kind of fault was met, and the retries got through all of them.
    assert set(faulty_http.plan.injected) == {"503", "short", "reset"}
    assert not list(cache.cache_dir.glob("*.part"))


def test_second_epoch_reads_from_cache_when_it_fits(
    http_server: FileServer, tmp_path: Path
) -> None:
    proxy = FaultProxy(http_server.url)
    try:
        manifest = load_manifest(proxy.url)
        cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
        order = plan_shard_order(manifest, "train")
        first, _ = read_epoch(manifest, "train", cache, order)
        gets = sum(n for path, n in proxy.gets.items() if path.endswith(".tar"))
        second, _ = read_epoch(
            manifest, "train", cache, plan_shard_order(manifest, "train", epoch=1)
        )
    finally:
        proxy.stop()
    assert first == second
    assert gets == len(order)
    assert sum(n for path, n in proxy.gets.items() if path.endswith(".tar")) == gets


def test_a_corrupt_object_is_refused_with_the_url(
    dataset: Path, http_server: FileServer, tmp_path: Path
) -> None:
    manifest = load_manifest(http_server.url)
    shard = manifest.split("train").shards[1]
    data = bytearray((dataset / shard.name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the sha256 can tell
    (dataset / shard.name).write_bytes(bytes(data))
    cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
    reader = ShardReader(manifest, "train", cache=cache)
    with pytest.raises(ShardReadError) as info:
        reader.sample(1, 0)
    message = str(info.value)
    assert f"{http_server.url}/{shard.name}" in message and "sha256" in message
    assert "manifest" in message  # says what to do: the object changed or the upload was damaged
    assert not list(cache.cache_dir.glob(f"{shard.sha256}.tar*"))  # nothing kept
    assert int(bytes(reader.sample(0, 0)["cls"])) >= 0  # other shards still read


def test_a_store_that_keeps_failing_names_the_url(http_server: FileServer, tmp_path: Path) -> None:
    proxy = FaultProxy(http_server.url, FaultPlan(every_503=1))
    try:
        manifest = load_manifest(proxy.url)
        cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
        with pytest.raises(ShardReadError, match="failed 8 times.*503") as info:
            ShardReader(manifest, "train", cache=cache).sample(0, 0)
    finally:
        proxy.stop()
    assert f"{proxy.url}/train-000000.tar" in str(info.value)
    assert proxy.gets["/train-000000.tar"] == FAST_RETRY.attempts  # bounded


def test_two_ranks_on_one_node_download_each_shard_once(
    http_server: FileServer, local_manifest: Manifest, tmp_path: Path
) -> None:
    proxy = FaultProxy(http_server.url)
    try:
        manifest = load_manifest(proxy.url)
        cache = ShardCache(tmp_path / "shared-cache", "10MB", retry=FAST_RETRY)
        order = plan_shard_order(manifest, "train")
        context = multiprocessing.get_context("spawn")
        start, queue = context.Event(), context.Queue()
        args = (queue, manifest, "train", cache, order, 2, start)
        ranks = [context.Process(target=rank_main, args=args) for _ in range(2)]
        for rank in ranks:  # two "ranks": processes sharing one cache_dir
            rank.start()
        start.set()
        results = [queue.get(timeout=120) for _ in ranks]
        for rank in ranks:
            rank.join(timeout=30)
    finally:
        proxy.stop()
    expected = local_digests(local_manifest, "train")
    assert all(not isinstance(r, BaseException) for r in results), results
    assert all(seen == expected for seen, _ in results)
    tar_gets = {path: n for path, n in proxy.gets.items() if path.endswith(".tar")}
    assert tar_gets == {f"/{s.name}": 1 for s in manifest.split("train").shards}


def test_pinned_shards_are_not_evicted(http_server: FileServer, tmp_path: Path) -> None:
    manifest = load_manifest(http_server.url)
    shards = manifest.split("train").shards
    cache = ShardCache(tmp_path / "cache", shards[0].bytes + 1000, retry=FAST_RETRY)
    with cache.acquire(manifest, shards[0]) as pinned:
        cache.fetch(manifest, shards[1])  # the limit holds one shard, but shard 0 is pinned
        assert pinned.tar.exists()
    cache.fetch(manifest, shards[2])  # unpinned now: the least recently used goes
    assert not pinned.tar.exists()
    assert folder_bytes(cache.cache_dir) <= cache.limit_bytes + shards[0].bytes


def test_prefetch_downloads_ahead_of_the_reader(http_server: FileServer, tmp_path: Path) -> None:
    manifest = load_manifest(http_server.url)
    shards = manifest.split("train").shards
    cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
    order = [shards[n] for n in (3, 1, 4, 0, 2)]
    cache.prefetch(manifest, [s.name for s in order], ahead=2)
    wanted = [cache.cache_dir / f"{s.sha256}.tar" for s in order]
    deadline = time.monotonic() + 20
    while not (wanted[0].exists() and wanted[1].exists()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wanted[0].exists() and wanted[1].exists() and not wanted[2].exists()
    cache.acquire(manifest, order[1]).release()  # reaching the 2nd queues the 3rd and 4th
    while not wanted[3].exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wanted[2].exists() and wanted[3].exists() and not wanted[4].exists()


def test_cache_pickles_for_dataloader_workers(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "c", "3GiB", storage_options={"anon": True}, retry=FAST_RETRY)
    copy = pickle.loads(pickle.dumps(cache))
    assert (copy.cache_dir, copy.limit_bytes, copy.storage_options, copy.retry) == (
        cache.cache_dir,
        3 * 2**30,
        {"anon": True},
        FAST_RETRY,
    )


def test_a_stale_partial_download_is_cleaned(http_server: FileServer, tmp_path: Path) -> None:
    manifest = load_manifest(http_server.url)
    shard = manifest.split("train").shards[0]
    cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
    stale = cache.cache_dir / f"{'ab' * 32}.tar.999999.part"  # left by a killed process
    stale.write_bytes(b"x" * 1000)
    cache.fetch(manifest, shard)
    assert not stale.exists()
