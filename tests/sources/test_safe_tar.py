"""safe_tar: members are streamed; absolute, `..`, link and device members refuse the archive."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from fastdata.sources.base import BadSourceError
from fastdata.sources.safe_tar import UnsafeArchiveError, check_member, iter_members


def _write_tar(path: Path, members: list[tarfile.TarInfo], data: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info in members:
            payload = data.get(info.name)
            if payload is not None:
                info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def test_wanted_members_are_streamed_in_order(tmp_path: Path) -> None:
    data = {"top/a": b"AAA", "./top/b": b"BB", "top/skip": b"S"}
    members = [_member("top", tarfile.DIRTYPE)] + [_member(n) for n in data]
    archive = _write_tar(tmp_path / "ok.tar.gz", members, data)
    got = {name: f.read() for name, f in iter_members(archive, {"top/a", "top/b"})}
    assert got == {"top/a": b"AAA", "top/b": b"BB"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.tar.gz"]  # nothing extracted


_UNSAFE = {
    "absolute": (_member("/tmp/evil"), "absolute path"),
    "dotdot": (_member("top/../../evil"), "'..' component"),
    "symlink": (_member("top/link", tarfile.SYMTYPE, "/etc/passwd"), "link"),
    "hardlink": (_member("top/hard", tarfile.LNKTYPE, "top/a"), "link"),
    "char device": (_member("top/dev", tarfile.CHRTYPE), "device file"),
    "fifo": (_member("top/fifo", tarfile.FIFOTYPE), "device file"),
}


@pytest.mark.parametrize("case", list(_UNSAFE))
def test_unsafe_member_refuses_the_archive(tmp_path: Path, case: str) -> None:
    bad, reason = _UNSAFE[case]
    archive = _write_tar(tmp_path / "bad.tar.gz", [_member("top/a"), bad], {"top/a": b"A"})
    with pytest.raises(UnsafeArchiveError) as info:
        # Not even asked for: an unsafe member anywhere refuses the whole archive.
        list(iter_members(archive, {"top/a"}))
    message = str(info.value)
    assert str(archive.resolve()) in message
    assert repr(bad.name) in message
    assert reason in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tar.gz"]


def test_check_member_normalizes_names() -> None:
    assert check_member("x.tar", _member("./a/b")) == "a/b"
    assert check_member("x.tar", _member("a/", tarfile.DIRTYPE)) == "a"
    assert check_member("x.tar", _member("a/./b")) == "a/b"


def test_not_a_tar_is_a_bad_source(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not an archive" * 10)
    with pytest.raises(BadSourceError, match="not a readable tar archive"):
        list(iter_members(junk, {"a"}))
