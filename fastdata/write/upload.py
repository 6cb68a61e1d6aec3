"""Publishing a shard folder to object storage, manifest last.

`fastdata shard ... s3://bucket/prefix` writes into a local temporary folder (`staged_upload`),
then `upload_dataset` copies the shards and index files, and the manifest only after all of them:
readers look for the manifest first, so none sees a half-uploaded dataset. An older manifest
at the destination is deleted before anything is replaced, for the same reason.

A failed upload keeps the local folder and says how to finish it:
`python -m fastdata.write.upload LOCAL_FOLDER URL`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastdata.format.manifest import MANIFEST_NAME, Manifest
from fastdata.format.manifest_io import load_manifest
from fastdata.remote.fs import join_url, remove, upload_file
from fastdata.remote.retry import DEFAULT_RETRY, RemoteError, RetryPolicy

__all__ = ["check_upload_url", "staged_upload", "upload_dataset"]

log = logging.getLogger(__name__)


def upload_dataset(
    local_dir: str | os.PathLike[str],
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> Manifest:
    """Copy the dataset in `local_dir` (shards, index files, then manifest.json) to `url`.

    Only the files the manifest lists are copied (not a writer's work files).

    Args:
        local_dir: a finished shard folder (holding manifest.json).
        url: the destination prefix, e.g. "s3://bucket/datasets/cifar100" or "gs://...".
        storage_options: passed to fsspec (e.g. `{"endpoint_url": ...}`).
        retry: attempts and backoff for each file.

    Returns:
        The uploaded manifest, with `root` set to `url`.

    Raises:
        ValueError: `url` is a web server (http/https takes no uploads) or a local path.
        RemoteError: a file could not be uploaded after the retries.
    """
    check_upload_url(url)
    local = Path(local_dir)
    manifest = load_manifest(local)
    names = [
        name
        for split in manifest.splits.values()
        for shard in split.shards
        for name in (shard.name, shard.index, shard.sums)  # .sum: verify_samples=True needs it
        if name and (name == shard.name or (local / name).exists())
    ] + [split.source_ids for split in manifest.splits.values() if split.source_ids]
    options = dict(storage_options or {})
    manifest_url = join_url(url, MANIFEST_NAME)
    if remove(manifest_url, options, retry):
        log.info("deleted the old manifest at %s before replacing its shards", manifest_url)
    for number, name in enumerate(names, start=1):
        upload_file(local / name, join_url(url, name), options, retry)
        log.debug("uploaded %s (%d/%d)", name, number, len(names))
    upload_file(local / MANIFEST_NAME, manifest_url, options, retry)  # last: the dataset is whole
    log.info("uploaded %d files and %s to %s", len(names), MANIFEST_NAME, url)
    return load_manifest(url, options)


def check_upload_url(url: str) -> None:
    """Raise ValueError unless `url` is an object-store URL (s3://, gs://, ...) fsspec writes to."""
    if "://" not in url or url.split("://", 1)[0] in ("http", "https"):
        raise ValueError(
            f"cannot upload to {url!r}: give an object-store URL (s3://, gs://); to serve over "
            "HTTP, copy the shard folder to the web server's directory"
        )


@contextmanager
def staged_upload(url: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """A temporary local folder to write a dataset into; uploaded to `url` when the block ends.

    The folder is deleted after a successful upload, and after a failure inside the block. When
    the upload itself fails, it is kept and the error says how to finish the upload.

    Raises:
        ValueError: `url` is no object-store URL (before any folder is made).
    """
    check_upload_url(url)
    staging = Path(tempfile.mkdtemp(prefix="fastdata-upload-"))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        upload_dataset(staging, url, storage_options)
    except (RemoteError, OSError) as exc:
        raise RemoteError(
            url,
            f"upload failed ({exc})",
            f"The finished shards are kept in {staging}; finish with "
            f"`python -m fastdata.write.upload {staging} {url}`, then delete that folder.",
        ) from exc
    shutil.rmtree(staging, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fastdata.write.upload LOCAL URL`: upload a finished shard folder."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("local", help="shard folder holding manifest.json")
    parser.add_argument("url", help="destination, e.g. s3://bucket/prefix")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        upload_dataset(args.local, args.url)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"upload: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
