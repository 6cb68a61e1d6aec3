"""The one door to remote storage: fsspec, imported only when a URL is used.

`s3://` goes through s3fs, `gs://` through gcsfs and `http(s)://` through fsspec's aiohttp
filesystem; all of them come with `pip install "fastdata[remote]"`. Every call here retries
transient failures (see `fastdata.remote.retry`) and checks what it downloads.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastdata.remote.config import Timeouts
from fastdata.remote.retry import (
    DEFAULT_RETRY,
    IntegrityError,
    RemoteError,
    RetryPolicy,
    retry_call,
)

__all__ = [
    "EXTRA_HINT",
    "download",
    "filesystem",
    "is_remote",
    "join_url",
    "read_bytes",
    "remove",
    "sha256_file",
    "upload_file",
    "with_timeouts",
]

EXTRA_HINT = 'Install the remote extra: pip install "fastdata[remote]"'
_HASH_CHUNK = 1 << 20


def is_remote(root: str | os.PathLike[str]) -> bool:
    """True for a URL (`s3://`, `gs://`, `http(s)://`, any fsspec protocol), False for a path."""
    return "://" in os.fspath(root)


def join_url(root: str, name: str) -> str:
    """`root/name` for a URL root."""
    return root.rstrip("/") + "/" + name


def with_timeouts(
    url: str, storage_options: Mapping[str, Any] | None, timeouts: Timeouts | None
) -> dict[str, Any]:
    """`storage_options` plus the connect and read timeouts, in the form `url`'s protocol takes
    (see the module docstring); options the caller set are kept."""
    options = dict(storage_options or {})
    timeouts = timeouts or Timeouts.from_env()
    protocol = url.split("://", 1)[0].lower()
    if protocol in ("http", "https"):
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault(
            "timeout",
            aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect, sock_read=timeouts.read
            ),
        )
        options["client_kwargs"] = client
    elif protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeouts.connect)
        config.setdefault("read_timeout", timeouts.read)
        options["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        import aiohttp

        options.setdefault(
            "requests_timeout",
            aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect, sock_read=timeouts.read
            ),
        )
    return options


def filesystem(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    timeouts: Timeouts | None = None,
) -> tuple[Any, str]:
    """The fsspec filesystem for `url` and the path inside it, with `timeouts` on its requests.

    Raises:
        RemoteError: fsspec, or the implementation for the URL's protocol, is not installed.
    """
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise RemoteError(url, "fsspec is not installed", EXTRA_HINT + ".") from exc
    try:
        return url_to_fs(url, **with_timeouts(url, storage_options, timeouts))
    except ImportError as exc:  # fsspec's message names the missing package (s3fs, gcsfs, aiohttp)
        raise RemoteError(url, f"no filesystem for this URL ({exc})", EXTRA_HINT + ".") from exc
    except ValueError as exc:  # an unknown protocol
        raise RemoteError(
            url, f"not a URL fastdata can read ({exc})", "Use s3://, gs:// or https://."
        ) from exc


def read_bytes(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    timeouts: Timeouts | None = None,
) -> bytes:
    """The whole object at `url` (small files: manifests, index files).

    Raises:
        FileNotFoundError: there is no object at `url`.
        RemoteError: after the retries, or for a failure another try does not fix.
    """
    fs, path = filesystem(url, storage_options, timeouts)
    return retry_call(lambda: fs.cat_file(path), url, "read", retry)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a local file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download(
    url: str,
    dest: Path,
    *,
    size: int | None = None,
    sha256: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    timeouts: Timeouts | None = None,
) -> int:
    """Stream the object at `url` into the local file `dest`, checked against `size` and `sha256`.

    A body cut short or with other bytes fails the check and is fetched again (each try rewrites
    `dest`). The caller renames `dest` into place: on failure, `dest` may hold a partial file.

    Returns:
        The bytes transferred over the network, all tries together.

    Raises:
        FileNotFoundError: there is no object at `url`.
        RemoteError: still failing after the retries (the message says the expected digest).
    """
    fs, path = filesystem(url, storage_options, timeouts)
    transferred = 0

    def once() -> None:
        nonlocal transferred
        fs.get_file(path, str(dest))
        got = dest.stat().st_size
        transferred += got
        if size is not None and got != size:
            raise IntegrityError(
                f"got {got} bytes, the manifest says {size} (a short or long body)"
            )
        if sha256 is not None and (digest := sha256_file(dest)) != sha256:
            raise IntegrityError(f"sha256 {digest[:12]}... but the manifest says {sha256[:12]}...")

    try:
        retry_call(once, url, "download", retry)
    except RemoteError as exc:
        if isinstance(exc.__cause__, IntegrityError):
            raise RemoteError(
                url,
                exc.reason,
                "The object differs from the manifest: it changed after the manifest was read "
                "(re-run the job), or the upload was damaged (run `fastdata shard` again).",
            ) from exc.__cause__
        raise
    return transferred


def upload_file(
    local: str | os.PathLike[str],
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> None:
    """Copy a local file to `url` (each try rewrites the whole object)."""
    fs, path = filesystem(url, storage_options)
    retry_call(lambda: fs.put_file(os.fspath(local), path), url, "upload", retry)


def remove(
    url: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy = DEFAULT_RETRY
) -> bool:
    """Delete the object at `url` if there is one; True when one was deleted."""
    fs, path = filesystem(url, storage_options)

    def once() -> bool:
        if not fs.exists(path):
            return False
        fs.rm_file(path)
        return True

    return retry_call(once, url, "delete", retry)
