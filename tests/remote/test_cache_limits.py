"""Two ranks of one node (two processes sharing a cache_dir), each with 2 DataLoader workers,
read a dataset over HTTP under cache limits from half a shard up to the whole dataset: every run
ends within its timeout, with every sample read (a limit too small to hold what the readers pin
is read over, with a warning; it never hangs)."""

from __future__ import annotations

import logging
import multiprocessing
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.remote import ShardCache
from fastdata.remote.config import Timeouts
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source
from tests.remote.conftest import FAST_RETRY
from tests.remote.readers import loader_rank_main
from tests.remote.servers import FaultPlan, FaultProxy, FileServer

#: Cache limits in shards (of the biggest), None: the whole dataset; below one shard per reader
#: (the case that deadlocked) runs always, the others with the slow tests.
# heavy: out of CI's default run (the tightest limit, 0.5, is the case that deadlocked).
_SLOW = [pytest.mark.slow, pytest.mark.heavy]
LIMITS = [
    0.5,
    pytest.param(1.0, marks=_SLOW),
    pytest.param(2.0, marks=_SLOW),
    pytest.param(4.0, marks=_SLOW),
    pytest.param(None, marks=_SLOW),
]


def run_two_ranks(url: str, cache_dir: Path, limit: float | None, timeout: float) -> set[int]:
    """Both ranks' labels; fails if a rank errs or is still running after `timeout` s."""
    manifest = load_manifest(url)
    shards = manifest.split("train").shards
    biggest = max(s.bytes for s in shards)
    total = sum(s.bytes for s in shards) * 2  # indexes and the test split: room to spare
    limit_bytes = total if limit is None else int(limit * biggest)
    cache = ShardCache(cache_dir, limit_bytes, retry=FAST_RETRY, timeouts=Timeouts(lock=30))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=loader_rank_main, args=(results, manifest, cache, r, 2, 20))
        for r in range(2)
    ]
    for rank in ranks:
        rank.start()
    try:
        got = dict(results.get(timeout=timeout) for _ in ranks)
    except queue.Empty:
        pytest.fail(f"limit {limit_bytes} bytes: a rank did not end within {timeout} s")
    finally:
        for rank in ranks:
            rank.join(timeout=10)
            if rank.is_alive():
                rank.kill()
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not errors, f"limit {limit_bytes} bytes: {errors}"
    assert not list(cache_dir.glob("*.part"))
    return set(got[0]) | set(got[1])


@pytest.fixture
def served(http_server: FileServer) -> Iterator[str]:
    """A slow store (0.3 s before each shard's answer): the workers fork during a download."""
    proxy = FaultProxy(http_server.url, FaultPlan(delay=0.3))
    yield proxy.url
    proxy.stop()


@pytest.mark.slow
@pytest.mark.parametrize("limit", LIMITS)
def test_two_ranks_with_workers_end_under_any_cache_limit(
    served: str, tmp_path: Path, limit: float | None
) -> None:
    labels = run_two_ranks(served, tmp_path / "cache", limit, timeout=120)
    assert labels == set(range(300))


@pytest.fixture(scope="module")
def cifar_sized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """3 train shards of 6,000 32x32 raw samples (~28 MB each, as CIFAR-100's 282 MB in 10
    shards), served."""
    out = tmp_path_factory.mktemp("cifar-sized")
    source = unique_label_source(n_train=18_000, n_test=10, side=32)
    write_shards(source, out, ShardOptions(max_count=6_000, workers=1, progress=False))
    server = FileServer(out)
    yield server.url
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("limit", LIMITS)
def test_cifar_sized_shards_end_under_any_cache_limit(
    cifar_sized: str, tmp_path: Path, limit: float | None
) -> None:
    labels = run_two_ranks(cifar_sized, tmp_path / "cache", limit, timeout=300)
    assert labels == set(range(18_000))


def test_a_limit_too_small_for_the_pins_warns_once_with_the_numbers(
    http_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = load_manifest(http_server.url)
    shards = manifest.split("train").shards
    limit = shards[0].bytes // 2
    # Three readers of one job (one ShardCache each, as in three processes) share the folder.
    caches = [ShardCache(tmp_path / "cache", limit, retry=FAST_RETRY) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        pins = [
            cache.acquire(manifest, shard) for cache, shard in zip(caches, shards[:3], strict=True)
        ]
    for pin in pins:
        assert pin.tar.stat().st_size > 0  # each is read, over the limit
        pin.release()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(limit) in warnings[0] and "raise the cache limit" in warnings[0].lower()
    assert f"{http_server.url}/{shards[0].name}" in warnings[0]
