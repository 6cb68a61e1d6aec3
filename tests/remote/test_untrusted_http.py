"""A manifest served over HTTP is as untrusted as a local one: its files stay under the served
prefix, and its index files are checked against their checksums when the reader loads them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.remote import ShardCache
from tests.conftest import rehash_indexes
from tests.remote.conftest import FAST_RETRY
from tests.remote.servers import FileServer


def _edit_first_shard(root: Path, **fields: object) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    data["splits"]["train"]["shards"][0].update(fields)
    path.write_text(json.dumps(data))


def test_a_served_manifest_naming_a_local_file_is_refused(
    dataset: Path, http_server: FileServer, tmp_path: Path
) -> None:
    local = tmp_path / "local-copy.tar"
    shutil.copy(dataset / "train-000000.tar", local)
    _edit_first_shard(dataset, name=str(local))
    with pytest.raises(ManifestError, match=r"local-copy\.tar.* leaves the dataset"):
        load_manifest(http_server.url)


@pytest.mark.parametrize(
    "name", ["http://127.0.0.1:9/train-000000.tar", "file:///etc/hostname", "../up.tar"]
)
def test_a_served_manifest_cannot_change_scheme_host_or_prefix(
    dataset: Path, http_server: FileServer, name: str
) -> None:
    _edit_first_shard(dataset, index=name)
    with pytest.raises(ManifestError, match="leaves the dataset"):
        load_manifest(http_server.url)


def _shift_first_index(root: Path) -> None:
    index = root / "train-000000.idx"
    lines = index.read_text().splitlines()
    step = int(lines[2].split()[1]) - int(lines[1].split()[1])
    shifted = [lines[0]]
    for line in lines[1:]:
        fields = line.split()
        for i in range(1, len(fields), 4):
            fields[i] = str(int(fields[i]) + step)
        shifted.append(" ".join(fields))
    index.write_text("\n".join(shifted) + "\n")


def test_a_shifted_index_over_http_is_refused(
    dataset: Path, http_server: FileServer, tmp_path: Path
) -> None:
    _shift_first_index(dataset)
    manifest = load_manifest(http_server.url)
    reader = ShardReader(manifest, "train", cache=ShardCache(tmp_path / "c1", retry=FAST_RETRY))
    # Refused as it is downloaded (checked against the manifest's index sha256), so no wrong
    # index is kept in the node's cache for every later reader.
    with pytest.raises(ShardReadError, match=r"train-000000\.idx: download failed .*sha256"):
        reader.sample(0, 0)
    reader.close()
    assert not list((tmp_path / "c1").glob("*.idx"))
    rehash_indexes(dataset)  # the served manifest now vouches for the wrong index
    manifest = load_manifest(http_server.url)
    reader = ShardReader(manifest, "train", cache=ShardCache(tmp_path / "c2", retry=FAST_RETRY))
    with pytest.raises(ShardReadError, match=r"tar header names 'train_\d{8}\.cls'"):
        reader.sample(0, 0)
    reader.close()


def test_verify_samples_over_http_checks_the_served_digests(
    dataset: Path, http_server: FileServer, tmp_path: Path
) -> None:
    tar = dataset / "train-000000.tar"
    fields = (dataset / "train-000000.idx").read_text().splitlines()[3].split()
    at = fields.index("rgb")
    data = bytearray(tar.read_bytes())
    data[int(fields[at + 1]) + 5] ^= 0x01  # one pixel of sample 2
    tar.write_bytes(bytes(data))
    # A re-hashed tar (as from a tampered upload): the cache's whole-shard check passes.
    _edit_first_shard(dataset, sha256=hashlib.sha256(bytes(data)).hexdigest())
    manifest = load_manifest(http_server.url)
    plain = ShardReader(manifest, "train", cache=ShardCache(tmp_path / "c", retry=FAST_RETRY))
    assert plain.key(0, 2) == fields[at + 3].split(".")[0]
    plain.sample(0, 2)  # the every-read checks cannot see a changed pixel
    plain.close()
    checked = ShardReader(
        manifest,
        "train",
        cache=ShardCache(tmp_path / "c", retry=FAST_RETRY),
        verify_samples=True,
    )
    checked.sample(0, 1)
    with pytest.raises(ShardReadError, match=r"sample 'train_\d{8}': sample bytes differ"):
        checked.sample(0, 2)
    checked.close()


def test_verify_over_http_downloads_each_shard_once_and_reports_a_changed_one(
    dataset: Path, http_server: FileServer
) -> None:
    from fastdata.read.verify import verify
    from tests.remote.servers import FaultProxy

    proxy = FaultProxy(http_server.url)  # no faults: counts the GETs
    try:
        report = verify(proxy.url, progress=False)
        assert report.ok, str(report)
        tars = {path: n for path, n in proxy.gets.items() if path.endswith(".tar")}
        manifest = load_manifest(dataset)
        assert len(tars) == sum(len(s.shards) for s in manifest.splits.values())
        assert set(tars.values()) == {1}, f"shards fetched more than once: {tars}"

        tar = dataset / "test-000000.tar"
        data = bytearray(tar.read_bytes())
        data[len(data) // 2] ^= 0x01
        tar.write_bytes(bytes(data))
        report = verify(proxy.url, progress=False)  # a report, never an exception
        assert not report.ok
        assert [s.split(":")[0] for s in report.bad_shards] == ["test-000000.tar"]
        assert "sha256" in report.bad_shards[0]
    finally:
        proxy.stop()
