"""Object storage: moto's S3-compatible server (moto[server], no Docker) on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fastdata.cli import main
from fastdata.format.manifest import MANIFEST_NAME, Manifest, ManifestError
from fastdata.format.manifest_io import load_manifest
from fastdata.remote import RemoteError, ShardCache
from fastdata.remote.fs import filesystem
from fastdata.write import upload as upload_module
from fastdata.write.upload import upload_dataset
from tests.conftest import write_jpeg_folder
from tests.remote.conftest import FAST_RETRY, FAULTS
from tests.remote.readers import plan_shard_order, read_epoch
from tests.remote.servers import FaultPlan, FaultProxy, MotoS3

URL = "s3://fastdata-test/datasets/tiny"


def test_upload_then_one_epoch_over_faulty_s3(
    moto_s3: MotoS3,
    dataset: Path,
    local_manifest: Manifest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uploaded: list[str] = []
    real_upload = upload_module.upload_file

    def recording_upload(local, url, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        uploaded.append(url.rsplit("/", 1)[1])
        return real_upload(local, url, *args, **kwargs)

    monkeypatch.setattr(upload_module, "upload_file", recording_upload)
    upload_dataset(dataset, URL, moto_s3.options(), retry=FAST_RETRY)
    assert uploaded[-1] == MANIFEST_NAME and uploaded.count(MANIFEST_NAME) == 1  # manifest last
    shards = [shard for split in local_manifest.splits.values() for shard in split.shards]
    assert all(shard.sums for shard in shards)  # tar, index and per-sample digests each
    assert len(uploaded) == 1 + 3 * len(shards)

    proxy = FaultProxy(moto_s3.url, FaultPlan(**FAULTS))
    try:
        options = moto_s3.options(proxy.url)
        manifest = load_manifest(URL, options)
        shards = manifest.split("train").shards
        biggest = max(s.bytes for s in shards)
        limit = 2 * biggest + biggest // 2
        cache = ShardCache(tmp_path / "cache", limit, storage_options=options, retry=FAST_RETRY)
        seen, sizes = read_epoch(manifest, "train", cache, plan_shard_order(manifest, "train"), 2)
    finally:
        proxy.stop()
    expected, _ = read_epoch(local_manifest, "train", None, list(range(len(shards))))
    assert seen == expected and len(seen) == 300  # every sample once, none corrupt
    assert max(sizes) <= limit + biggest
    assert set(proxy.plan.injected) == {"503", "short", "reset"}


def test_reupload_hides_the_old_manifest_first(
    moto_s3: MotoS3, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = moto_s3.options()
    upload_dataset(dataset, URL, options, retry=FAST_RETRY)
    fs, _ = filesystem(URL, options)
    real_upload = upload_module.upload_file
    states: list[bool] = []

    def watching_upload(local, url, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        states.append(fs.exists(f"{URL}/{MANIFEST_NAME}"))
        fs.invalidate_cache()
        return real_upload(local, url, *args, **kwargs)

    monkeypatch.setattr(upload_module, "upload_file", watching_upload)
    upload_dataset(dataset, URL, options, retry=FAST_RETRY)
    assert not any(states)  # while shards were replaced, no reader could find a manifest


def test_a_missing_dataset_says_so(moto_s3: MotoS3) -> None:
    with pytest.raises(ManifestError, match="no manifest.json in s3://fastdata-test/nothing"):
        load_manifest("s3://fastdata-test/nothing", moto_s3.options())


def test_cli_shards_straight_to_s3(
    moto_s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # The command line has no storage options: botocore reads the endpoint from the environment.
    from s3fs import S3FileSystem

    moto_s3.as_environment(monkeypatch)
    folder = write_jpeg_folder(tmp_path / "photos")
    url = "s3://fastdata-test/photos"
    try:
        code = main(["shard", "folder", str(folder), url, "--workers", "1", "--no-progress"])
        assert code == 0
        manifest = load_manifest(url)
    finally:
        S3FileSystem.clear_instance_cache()
    assert sum(s.num_samples for s in manifest.splits.values()) == 12
    printed = capsys.readouterr().out
    assert printed.startswith(f"{url}: folder shards") and "fastdata-upload" not in printed


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec  # noqa: F401 - loads fsspec.registry, whose table caches loaded classes

    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now fails
    with pytest.raises(RemoteError, match=r'pip install "fastdata\[remote\]"') as info:
        filesystem("s3://bucket/data")
    assert "s3://bucket/data" in str(info.value)
