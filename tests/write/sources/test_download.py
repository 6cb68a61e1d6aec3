"""download() against a local HTTP server: verified files land, bad ones leave nothing."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from fastdata.write.sources.download import DownloadError, download, file_md5


def _serve(served: Path, name: str, size: int = 3 * 1024 * 1024 + 17) -> tuple[bytes, str]:
    payload = bytes(range(256)) * (size // 256) + b"tail"
    (served / name).write_bytes(payload)
    return payload, hashlib.md5(payload).hexdigest()


def test_good_md5_leaves_the_file(http_server: tuple[str, Path], tmp_path: Path) -> None:
    url, served = http_server
    payload, md5 = _serve(served, "blob.tar.gz")
    dest = tmp_path / "cache" / "sub" / "blob.tar.gz"
    assert download(f"{url}/blob.tar.gz", dest, md5.upper(), progress=False) == dest
    assert dest.read_bytes() == payload
    assert file_md5(dest) == md5
    assert sorted(p.name for p in dest.parent.iterdir()) == ["blob.tar.gz"]  # no .part left


def test_bad_md5_raises_and_leaves_nothing(http_server: tuple[str, Path], tmp_path: Path) -> None:
    url, served = http_server
    _, md5 = _serve(served, "blob.bin")
    dest = tmp_path / "cache" / "blob.bin"
    with pytest.raises(DownloadError) as info:
        download(f"{url}/blob.bin", dest, "0" * 32, progress=False)
    message = str(info.value)
    assert "0" * 32 in message and md5 in message and f"{url}/blob.bin" in message
    assert list(dest.parent.iterdir()) == []


def test_http_404_is_a_clear_error(http_server: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = http_server
    dest = tmp_path / "out" / "missing.bin"
    with pytest.raises(DownloadError, match="HTTP 404") as info:
        download(f"{url}/missing.bin", dest, None, progress=False)
    assert f"{url}/missing.bin" in str(info.value)
    assert list(dest.parent.iterdir()) == []


def test_unreachable_server_says_offline(tmp_path: Path) -> None:
    # A port that was just free: nothing listens there, so the connection is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(DownloadError, match="offline") as info:
        download(f"http://127.0.0.1:{port}/x.tar.gz", tmp_path / "x.tar.gz", None, progress=False)
    assert "local path" in str(info.value)
    assert list(tmp_path.iterdir()) == []
