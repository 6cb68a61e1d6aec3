"""Fuzz remote reads: a small dataset served over HTTP behind a proxy that, per seeded case,
answers some shard, index or digest-file GETs with a 503, a reset, a stall, half a body (then
closes), half a body it says is whole, or a body with one byte changed.

Every case must end within its time limit, and the reader (verify_samples=True, so that the
index checksum, the tar headers and the per-sample digests are all checked) must either deliver
every sample's bytes equal to the original, or raise a clear error (`ShardReadError`,
`RemoteError` or `ManifestError`) naming the URL or the shard. No case may write outside its
cache folder. FASTDATA_FUZZ_CASES=N runs N / 3 cases (default 24, ~15 s);
FASTDATA_FUZZ_SEED picks the seed.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.remote import RetryPolicy, ShardCache
from fastdata.remote.config import Timeouts
from fastdata.remote.retry import RemoteError
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source
from tests.remote.servers import FaultPlan, FaultProxy, FileServer
from tests.write.test_fuzz_lists import _time_limit

_ASKED = os.environ.get("FASTDATA_FUZZ_CASES")
CASES = max(1, int(_ASKED) // 3) if _ASKED else 24  # a case takes ~0.5 s (the proxy's stop)
SEED = int(os.environ.get("FASTDATA_FUZZ_SEED", "0"))
CASE_TIMEOUT_S = 60  # a stalled request costs 0.5 s a try; a hang is what this catches
RETRY = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
TIMEOUTS = Timeouts(connect=1.0, read=0.5, lock=5.0)
ACCEPTED = (ShardReadError, RemoteError, ManifestError)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(dataset folder, its server, key -> components read locally)."""
    root = tmp_path_factory.mktemp("fuzz-remote") / "dataset"
    write_shards(
        unique_label_source(n_train=40, n_test=4),
        root,
        ShardOptions(max_count=16, workers=1, progress=False),
    )
    reader = ShardReader(load_manifest(root), "train")
    original = {}
    for shard, info in enumerate(reader.shards):
        for index in range(info.num_samples):
            parts = reader.sample(shard, index)
            original[reader.key(shard, index)] = {e: bytes(v) for e, v in parts.items()}
    reader.close()
    server = FileServer(root)
    yield root, server, original
    server.stop()


def _plan(rng: random.Random) -> FaultPlan:
    def every() -> int:
        return rng.choice([0, 0, 2, 3, 5])

    return FaultPlan(
        every_503=every(),
        every_short=every(),
        every_wrong=every(),
        every_truncated=every(),
        resets=frozenset(rng.sample(range(1, 12), rng.randint(0, 2))),
        stalls=frozenset(rng.sample(range(1, 12), rng.choice([0, 0, 1]))),
        suffix=rng.choice([".tar", ".tar", ".idx", ".sum"]),
    )


def _read_all(url: str, cache: ShardCache) -> dict[str, dict[str, bytes]]:
    manifest = load_manifest(url)
    reader = ShardReader(manifest, "train", max_open=1, cache=cache, verify_samples=True)
    seen: dict[str, dict[str, bytes]] = {}
    try:
        for shard, info in enumerate(reader.shards):
            for index in range(info.num_samples):
                parts = reader.sample(shard, index)
                seen[reader.key(shard, index)] = {e: bytes(v) for e, v in parts.items()}
    finally:
        reader.close()
    return seen


def test_fuzzed_remote_responses_read_correctly_or_fail_clearly(served, tmp_path: Path) -> None:
    root, server, original = served
    outcomes = {"ok": 0, "error": 0}
    for case in range(CASES):
        rng = random.Random(f"remote-{SEED}-{case}")
        plan = _plan(rng)
        proxy = FaultProxy(server.url, plan)
        work = tmp_path / f"{case:04d}"
        cache = ShardCache(work / "cache", "10MB", retry=RETRY, timeouts=TIMEOUTS)
        try:
            with _time_limit(CASE_TIMEOUT_S):
                try:
                    seen = _read_all(proxy.url, cache)
                except ACCEPTED as exc:
                    names = [proxy.url] + [p.name for p in root.iterdir()]
                    assert any(n in str(exc) for n in names), f"unclear error: {exc}"
                    outcomes["error"] += 1
                else:
                    assert seen.keys() == original.keys(), "samples lost or added"
                    wrong = [k for k in seen if seen[k] != original[k]]
                    assert not wrong, f"wrong bytes delivered without an error: {wrong[:5]}"
                    outcomes["ok"] += 1
        except BaseException as exc:
            raise AssertionError(
                f"remote fuzz case {case} (seed {SEED}) failed: {exc!r}\n  plan: {plan}"
            ) from exc
        finally:
            proxy.stop()
        assert [p.name for p in tmp_path.iterdir()] == [work.name], "wrote outside the case"
        assert [p.name for p in work.iterdir()] == ["cache"], "wrote outside the cache"
        shutil.rmtree(work)
    print(f"remote fuzz outcomes over {CASES} cases (seed {SEED}): {outcomes}")
    assert outcomes["ok"] and outcomes["error"], outcomes


def test_a_stalled_digest_file_download_keeps_the_caches_timeouts(served, tmp_path: Path) -> None:
    """Found by seed 0, case 10: the per-sample digest file was fetched with the default 30 s
    read timeout and retry policy, not the cache's, so one stalled GET held the reader 35 s."""
    _, server, original = served
    proxy = FaultProxy(server.url, FaultPlan(stalls=frozenset({1}), suffix=".sum"))
    cache = ShardCache(tmp_path / "cache", "10MB", retry=RETRY, timeouts=TIMEOUTS)
    try:
        with _time_limit(15):  # the cache's 0.5 s read timeout, then a second try
            seen = _read_all(proxy.url, cache)
    finally:
        proxy.stop()
    assert seen == original and proxy.plan.injected["stall"] == 1
