"""Checksummed download of a dataset archive.

The file is streamed to `<dest>.part` and renamed only once its MD5 matches, so `dest` either does
not exist or is complete and verified; an interrupted or corrupted download leaves nothing behind.
urllib and tqdm are imported when a download runs: every `fastdata shard` imports this module.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fastdata.write.sources.base import BadSourceError

__all__ = ["DownloadError", "download", "file_md5"]

_CHUNK = 1 << 20


class DownloadError(BadSourceError):
    """A download failed (network, HTTP status) or its checksum did not match."""


def file_md5(path: Path) -> str:
    """Hex MD5 digest of a file, read in 1 MiB chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(
    url: str, dest: Path, md5: str | None, *, progress: bool = True, timeout: float = 60
) -> Path:
    """Download `url` to `dest`, verifying its MD5.

    Args:
        url: http(s) URL of the file.
        dest: where the file goes; its folder is created.
        md5: expected hex digest; None skips the check (only for files without a published one).
        progress: show a tqdm progress bar on stderr.
        timeout: seconds to wait for the server before giving up.

    Returns:
        `dest`.

    Raises:
        DownloadError: the server could not be reached, answered with an error status, or the
            digest differs (the partial file is deleted in every case).
    """
    import urllib.error

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # name + ".part" rather than with_suffix: "x.tar.gz" and "x.tar.xz" must not share "x.tar.part".
    part = dest.with_name(dest.name + ".part")
    try:
        actual = _fetch(url, part, progress=progress, timeout=timeout)
    except urllib.error.HTTPError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"downloading {url} failed: HTTP {exc.code} {exc.reason}. Check the URL, or download "
            "the file by other means and pass its local path as the input."
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        part.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise DownloadError(
            f"could not download {url} ({reason}); this machine may be offline. Download the file "
            f"on a machine with internet access, copy it here and pass its local path as the "
            f"input instead of download=True (it would be saved as {dest})."
        ) from exc
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if md5 is not None and actual != md5.lower():
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"checksum mismatch for {url}: expected MD5 {md5.lower()}, got {actual}. The download "
            "was corrupted or the server sent a different file; the partial file was deleted, "
            "try again."
        )
    os.replace(part, dest)
    return dest


def _fetch(url: str, part: Path, *, progress: bool, timeout: float) -> str:
    """Stream `url` into `part`; return the hex MD5 of what was written."""
    import urllib.request

    from tqdm.auto import tqdm

    digest = hashlib.md5(usedforsecurity=False)
    with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=part.name.removesuffix(".part"),
            disable=not progress,
        ) as bar:
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()
