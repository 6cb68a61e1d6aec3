"""The cpu backend asks the shard cache to download ahead, in the order its plan reads shards;
and a mix may hold a remote and a local dataset."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fastdata import CacheSettings, ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.plan import rows_to_refs
from fastdata.remote import ShardCache
from tests.remote.conftest import FAST_RETRY
from tests.remote.servers import FileServer


def test_cpu_loader_prefetches_in_plan_order(
    http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = load_manifest(http_server.url)
    cache = ShardCache(tmp_path / "cache", "10MB", retry=FAST_RETRY)
    calls: list[list[str]] = []
    original = ShardCache.prefetch

    def spy(self, manifest, shards, ahead=2):
        calls.append([s.name for s in shards])
        return original(self, manifest, shards, ahead)

    monkeypatch.setattr(ShardCache, "prefetch", spy)
    spec = LoaderSpec(manifest, "train", train=True, batch_size=32, seed=3, cache=cache)
    labels = [y for _, batch in make_cpu_loader(spec) for y in batch.tolist()]
    assert sorted(labels) == list(range(300))
    plan = spec.plan(0)
    shards = rows_to_refs(np.concatenate(plan.rows), spec.shard_sizes)[:, 0]
    names = [manifest.split("train").shards[s].name for s in dict.fromkeys(shards.tolist())]
    assert calls == [names]  # one call per pass: every shard, in the order it is first read


def test_a_mix_reads_a_remote_and_a_local_dataset(http_server: FileServer, dataset: Path) -> None:
    dm = ShardDataModule(
        [http_server.url, dataset],  # plain roots weigh 1 each
        batch_size=50,
        backend="cpu",
        workers=WorkerSettings(num_workers=0),
        cache=CacheSettings(dir=dataset.parent / "cache", limit="10MB"),
    )
    dm.setup("fit")
    counts = Counter(y for _, batch in dm.train_dataloader() for y in batch.tolist())
    # The same dataset twice: one class list, so each sample's label comes up once per copy.
    assert counts == Counter({label: 2 for label in range(300)})
    assert any((dataset.parent / "cache").glob("*.tar"))  # the remote half came through the cache
