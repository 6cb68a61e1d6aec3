"""`write_shards` into object storage from the library (not only `fastdata shard`)."""

from __future__ import annotations

import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from tests.conftest import write_jpeg_folder
from tests.remote.conftest import moto_s3  # noqa: F401 - the fixture
from tests.remote.servers import MotoS3


@pytest.fixture
def photos_to_s3(moto_s3: MotoS3, tmp_path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    """A photo folder's source, with moto's S3 as every client's endpoint; s3fs's cached
    instances dropped after."""
    from s3fs import S3FileSystem

    moto_s3.as_environment(monkeypatch)
    yield open_source("folder", write_jpeg_folder(tmp_path / "photos"))
    S3FileSystem.clear_instance_cache()


def test_write_shards_to_an_s3_url_uploads_and_names_the_url(photos_to_s3, tmp_path) -> None:
    source = photos_to_s3
    options = ShardOptions(max_count=5, workers=1, progress=False)
    local = write_shards(source, tmp_path / "local", options)
    url = "s3://fastdata-test/library"
    manifest = write_shards(source, url, options)
    uploaded = load_manifest(url)
    assert manifest.root == url and uploaded.root == url
    assert uploaded.splits == local.splits  # the same shards, byte for byte (sha256 in each)


def test_a_web_url_is_refused_before_anything_is_written(tmp_path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    source = open_source("folder", write_jpeg_folder(tmp_path / "photos"))
    with pytest.raises(ValueError, match=r"cannot upload to 'https://host/data': give an object"):
        write_shards(source, "https://host/data", ShardOptions(workers=1, progress=False))
    assert list((tmp_path / "tmp").iterdir()) == []  # no staging folder left behind


def test_a_url_holding_the_same_dataset_is_kept_and_another_is_refused(
    photos_to_s3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastdata.write import ShardingError
    from fastdata.write.upload import staged_upload

    source = photos_to_s3
    options = ShardOptions(max_count=5, workers=1, progress=False)
    url = "s3://fastdata-test/kept"
    first = write_shards(source, url, options)
    staged = []
    monkeypatch.setattr(  # a second upload would stage a folder first
        "fastdata.write.upload.staged_upload",
        lambda *a, **k: staged.append(a) or staged_upload(*a, **k),
    )
    again = write_shards(source, url, options)
    assert staged == [] and again.splits == first.splits  # found, nothing written
    with pytest.raises(ShardingError, match=r"already holds a different dataset.*--overwrite"):
        write_shards(source, url, ShardOptions(max_count=3, workers=1, progress=False))
    replaced = write_shards(
        source, url, ShardOptions(max_count=3, workers=1, progress=False, overwrite=True)
    )
    assert load_manifest(url).splits == replaced.splits != first.splits
