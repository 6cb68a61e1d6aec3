"""Fixtures for the remote tests: a tiny dataset, and loopback servers stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdata.format.manifest import Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.remote import RetryPolicy
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source
from tests.remote.servers import FaultPlan, FaultProxy, FileServer, MotoS3

pytest.importorskip("fsspec", reason='remote tests need pip install "fastdata[remote]"')
pytest.importorskip("aiohttp", reason='remote tests need pip install "fastdata[remote]"')

#: Fast retries: the faults are injected, the waits need not be long.
FAST_RETRY = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.05)
#: 503 every 4th shard GET, half a body every 5th, a reset at the 2nd and 7th.
FAULTS = dict(every_503=4, every_short=5, resets=frozenset({2, 7}))


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """300 train + 20 test 8x8 raw samples, 64 per shard (5 train shards of ~200 kB)."""
    out = tmp_path / "dataset"
    source = unique_label_source(n_train=300, n_test=20)
    write_shards(source, out, ShardOptions(max_count=64, workers=1, progress=False))
    return out


@pytest.fixture
def local_manifest(dataset: Path) -> Manifest:
    return load_manifest(dataset)


@pytest.fixture
def http_server(dataset: Path) -> Iterator[FileServer]:
    server = FileServer(dataset)
    yield server
    server.stop()


@pytest.fixture
def faulty_http(http_server: FileServer) -> Iterator[FaultProxy]:
    """Python's HTTP server serving `dataset`, behind a proxy that injects `FAULTS`."""
    proxy = FaultProxy(http_server.url, FaultPlan(**FAULTS))
    yield proxy
    proxy.stop()


@pytest.fixture
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server (moto[server]) with an empty bucket `fastdata-test`."""
    pytest.importorskip("moto.server", reason='needs pip install "moto[server]"')
    pytest.importorskip("s3fs", reason='needs pip install "fastdata[remote]"')
    server = MotoS3()
    server.create_bucket("fastdata-test")
    yield server
    server.stop()
