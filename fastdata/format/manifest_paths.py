"""The one rule for the paths a manifest names: every file resolves inside the dataset root.

A manifest is untrusted input: a tampered or hand-edited one could name `../../etc/passwd` or a
FIFO. Every file it names (shard tars, index and digest files) must resolve inside the dataset
root (or, for a remote dataset, under the same scheme, host and path prefix) as a regular file;
`data_root` (`fastdata index` of tars that live elsewhere) must be an absolute folder or a plain
URL prefix. `fastdata.format.manifest_io` applies these checks when it reads a manifest, and
`fastdata index` when it writes one. Each error names the entry and says what to do.
"""

from __future__ import annotations

import os
import posixpath
import stat
from typing import Any
from urllib.parse import unquote, urlsplit

from fastdata.format.manifest import Manifest, ManifestError, _is_remote, _join

__all__ = ["check_data_root", "check_files", "check_name"]


def check_name(root: str, name: Any, what: str) -> None:
    """Refuse a file name that would resolve outside the dataset root (or remote prefix).

    A name must be a relative path of plain parts: no absolute path, no drive, no `..`, no
    backslash, no URL scheme (also after %-decoding, which a web server may apply).

    Raises:
        ManifestError: naming `what` (the entry) and the name.
    """
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{what}: file name must be a non-empty string, got {name!r}")
    for text in {name, unquote(name)}:
        parts = text.split("/")
        if (
            text.startswith("/")
            or "\\" in text
            or "\x00" in text
            or ":" in parts[0]
            or any(part in ("..", ".") for part in parts)
        ):
            raise ManifestError(
                f"{what}: {name!r} leaves the dataset (every file a manifest names must be a "
                "relative path inside its folder: no leading '/', no '..', no '\\', no URL "
                "scheme); refusing a tampered or hand-edited manifest: re-run `fastdata shard`"
            )
        if "" in parts:
            raise ManifestError(
                f"{what}: {name!r} has an empty path part (a trailing or doubled '/'): every "
                "file a manifest names is a plain relative path; re-run `fastdata shard`"
            )


_DATA_ROOT_SCHEMES = ("http", "https", "s3", "s3a", "gs", "gcs")


def check_data_root(root: str, value: Any) -> str | None:
    """The manifest's `data_root` (where another tool's tars are), checked; None when absent.

    It must be an absolute, normalized folder path (no `..`, no `.` parts), only in a local
    manifest (a manifest read from a server never points at the reader's own files), or an
    http(s)://, s3:// or gs:// URL prefix with a host and no `..`, query or fragment. Each tar's
    name is then checked to stay inside it (`check_name`, `check_files`).

    Raises:
        ManifestError: naming the root and the value.
    """
    if value is None:
        return None
    bad = f"{root}: data_root {value!r}"
    if not isinstance(value, str) or not value or "\x00" in value or "\\" in value:
        raise ManifestError(f"{bad} must be an absolute folder or a URL prefix")
    if _is_remote(value):
        got = urlsplit(value)
        parts = unquote(got.path).split("/")
        if (
            got.scheme.lower() not in _DATA_ROOT_SCHEMES
            or not got.netloc
            or got.query
            or got.fragment
            or any(part in ("..", ".") for part in parts)
        ):
            raise ManifestError(
                f"{bad} is not a plain http(s)://, s3:// or gs:// prefix (host, path, no '..', "
                "query or fragment); refusing a tampered or hand-edited manifest: re-run "
                "`fastdata index`"
            )
        return value
    if _is_remote(root):
        raise ManifestError(
            f"{bad}: a manifest read from {root} may not point at local files; refusing it"
        )
    if (
        not os.path.isabs(value)
        or os.path.normpath(value) != value.rstrip("/")
        or (".." in value.split("/"))
    ):
        raise ManifestError(
            f"{bad} must be an absolute, normalized folder (no '..'); refusing a tampered or "
            "hand-edited manifest: re-run `fastdata index`"
        )
    return value


def check_files(manifest: Manifest) -> None:
    """The path rule on the files themselves: each named file resolves inside its root.

    The root of a shard's tar is the manifest's `data_root` when it has one (`fastdata index`
    of shards that live elsewhere), else the manifest's folder, which also holds every index
    and digest file. Local: after following symlinks each file that exists lies inside its root
    folder and is a regular file (a FIFO, device or folder is refused; a missing file is
    reported by the reader that needs it). Remote: each URL keeps the root's scheme, host and
    path prefix.

    Raises:
        ManifestError: naming the shard entry and the file.
    """
    for split_name, split in manifest.splits.items():
        for shard in split.shards:
            for what, name in (("name", shard.name), ("index", shard.index), ("sums", shard.sums)):
                if name is None:
                    continue
                root = manifest.root
                if what == "name" and manifest.data_root is not None:
                    root = manifest.data_root
                where = f"{manifest.root}: shard {shard.name!r} (split {split_name!r}) {what}"
                _check_file(root, _join(root, name), where)


def _check_file(root: str, url: str, where: str) -> None:
    """`check_files` of one file under `root`."""
    if _is_remote(root):
        base = urlsplit(root.rstrip("/") + "/")
        got = urlsplit(url)
        inside = (got.scheme, got.netloc) == (base.scheme, base.netloc) and (
            posixpath.normpath(got.path) + "/"
        ).startswith(base.path)
        if not inside:
            raise ManifestError(f"{where}: {url} is outside {root}")
        return
    base_path = os.path.realpath(root)
    real = os.path.realpath(url)
    if os.path.commonpath([real, base_path]) != base_path:
        raise ManifestError(
            f"{where}: {url} resolves to {real}, outside the dataset folder "
            f"{base_path} (a symlink out of it?); refusing it"
        )
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:  # a name too long, a component that is not a folder...
        raise ManifestError(
            f"{where}: {url} cannot be looked up ({exc.strerror}); refusing it"
        ) from exc
    if not stat.S_ISREG(mode):
        raise ManifestError(
            f"{where}: {url} is not a regular file (a FIFO, device or folder); refusing it"
        )
