"""safe_tar: members are streamed; absolute, `..`, link and device members refuse the archive."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fastdata.write.sources.base import BadSourceError
from fastdata.write.sources.safe_tar import UnsafeArchiveError, check_member, iter_members


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
    with pytest.raises(BadSourceError, match="not a readable tar archive") as info:
        list(iter_members(junk, {"a"}))
    assert "220 bytes, less than one tar header" in str(info.value)


# ----------------------------------------------------------------------------- the stream reader
# iter_members parses the tar stream itself (one copy of each member's bytes instead of tarfile's
# four): what it yields must be what tarfile reads, for every format and compression.

_LONG = "top/" + "a-long-folder-name/" * 8 + "file-with-a-long-name.bin"  # > 100 bytes


def _archive(path: Path, mode: str, fmt: int, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, mode, format=fmt) as tar:
        tar.addfile(_member("top", tarfile.DIRTYPE))
        for name, payload in files.items():
            info = _member(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def _tarfile_reads(path: Path, names: set[str]) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name in names
        }


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:bz2", "w:xz"])
@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_members_read_as_tarfile_reads_them(tmp_path: Path, mode: str, fmt: int) -> None:
    files = {
        "top/small": b"x",
        "top/empty": b"",
        "top/block": bytes(range(256)) * 2,  # exactly one 512-byte block
        "top/odd": b"\x00\xff" * 7001,
        # USTAR keeps a long path in its prefix field (a name part <= 100 bytes).
        _LONG if fmt != tarfile.USTAR_FORMAT else "top/" + "p" * 120 + "/name": b"long name",
    }
    if fmt == tarfile.PAX_FORMAT:
        files["top/naïve-ü.bin"] = b"pax keeps utf-8 names"
    archive = _archive(tmp_path / "a.tar", mode, fmt, files)
    got = {name: f.read() for name, f in iter_members(archive, set(files))}
    assert got == _tarfile_reads(archive, set(files)) == files


def test_a_plain_tar_whose_first_name_starts_like_bzip2_is_a_tar(tmp_path: Path) -> None:
    archive = tmp_path / "bzh.tar"
    with tarfile.open(archive, "w") as tar:
        info = _member("BZh_notes/a")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    got = {name: f.read() for name, f in iter_members(archive, {"BZh_notes/a"})}
    assert got == _tarfile_reads(archive, {"BZh_notes/a"}) == {"BZh_notes/a": b"abc"}


def test_a_partly_read_member_does_not_shift_the_next(tmp_path: Path) -> None:
    files = {"top/a": b"A" * 5000, "top/b": b"B" * 700, "top/c": b"C" * 3}
    archive = _archive(tmp_path / "a.tar.gz", "w:gz", tarfile.GNU_FORMAT, files)
    got = {name: f.read(10) for name, f in iter_members(archive, set(files))}
    assert got == {"top/a": b"A" * 10, "top/b": b"B" * 10, "top/c": b"CCC"}


def test_concatenated_gzip_members_and_zero_padding(tmp_path: Path) -> None:
    # `cat a.gz b.gz` is one gzip file to gzip and tarfile; padding zeros after it are ignored.
    plain = _archive(tmp_path / "a.tar", "w", tarfile.GNU_FORMAT, {"top/a": b"1" * 9000})
    raw = plain.read_bytes()
    archive = tmp_path / "cat.tar.gz"
    archive.write_bytes(gzip.compress(raw[:7000]) + gzip.compress(raw[7000:]) + bytes(300))
    assert {n: f.read() for n, f in iter_members(archive, {"top/a"})} == {"top/a": b"1" * 9000}


def test_highly_compressible_members_inflate_in_bounded_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Zeros inflate ~1000x: each inflate call stops at _MAX_INFLATE and keeps the rest of its
    # input, and the output zlib still holds at the end of the file is flushed.
    import fastdata.write.sources.safe_tar as safe_tar

    monkeypatch.setattr(safe_tar, "_MAX_INFLATE", 4096)
    monkeypatch.setattr(safe_tar, "_READ_SIZE", 1000)
    files = {"top/zeros": bytes(3_000_000), "top/tail": b"end"}
    archive = _archive(tmp_path / "z.tar.gz", "w:gz", tarfile.GNU_FORMAT, files)
    got = {name: f.read() for name, f in iter_members(archive, set(files))}
    assert got == files


@pytest.mark.parametrize("compression", ["gz", "bz2", "xz"])
@pytest.mark.parametrize(
    "damage",
    ["truncated", "cut inside the header", "corrupt byte", "trailing garbage", "empty file"],
)
def test_damaged_compressed_archive_is_a_bad_source(
    tmp_path: Path, compression: str, damage: str
) -> None:
    payload = bytes(range(251)) * 4000  # ~1 MB that does not compress to nothing
    archive = _archive(
        tmp_path / f"a.tar.{compression}",
        f"w:{compression}",
        tarfile.GNU_FORMAT,
        {"top/a": payload},
    )
    if damage == "trailing garbage" and compression != "gz":
        pytest.skip("bz2 and lzma, like their Python modules, ignore garbage after the stream")
    data = bytearray(archive.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "cut inside the header":
        data = data[:5]
    elif damage == "corrupt byte":
        data[len(data) // 2] ^= 0xFF
    elif damage == "trailing garbage":
        data += b"garbage"
    else:
        data = bytearray()
    archive.write_bytes(bytes(data))
    with pytest.raises(BadSourceError, match="not a readable tar archive"):
        for _, f in iter_members(archive, {"top/a"}):
            f.read()


def test_a_tar_cut_inside_a_member_is_a_bad_source(tmp_path: Path) -> None:
    plain = _archive(tmp_path / "a.tar", "w", tarfile.GNU_FORMAT, {"top/a": b"x" * 5000})
    plain.write_bytes(plain.read_bytes()[: 512 * 2 + 2000])  # dir header, a's header, 2000 bytes
    with pytest.raises(BadSourceError, match="ends inside a member"):
        for _, f in iter_members(plain, {"top/a"}):
            f.read()


def test_a_tar_without_its_end_marker_reads_as_tarfile_reads_it(tmp_path: Path) -> None:
    plain = _archive(tmp_path / "a.tar", "w", tarfile.GNU_FORMAT, {"top/a": b"x" * 5000})
    plain.write_bytes(plain.read_bytes()[: 512 * 2 + 5120])  # every member whole, no zero blocks
    assert {n: f.read() for n, f in iter_members(plain, {"top/a"})} == {"top/a": b"x" * 5000}


def test_a_sparse_member_is_refused(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "s.tar", "w", tarfile.GNU_FORMAT, {"top/a": b"x" * 600})
    data = bytearray(archive.read_bytes())
    header = data[512:1024]  # top/a's header, after the folder's
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[148:156] = b"        "
    header[148:156] = b"%06o\x00 " % sum(header)
    data[512:1024] = header
    archive.write_bytes(bytes(data))
    with pytest.raises(BadSourceError, match="sparse"):
        list(iter_members(archive, {"top/a"}))


def _raw_header(name: str, size_field: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A ustar header with its size field as given (octal or base-256) and a valid checksum."""
    header = bytearray(tarfile.BLOCKSIZE)
    header[0 : len(name)] = name.encode()
    header[100:108] = b"0000644\x00"
    header[124:136] = size_field
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"        "
    header[148:156] = b"%06o\x00 " % sum(header)
    return bytes(header)


def _base256(value: int) -> bytes:
    """tarfile's base-256 number field (12 bytes): any signed value."""
    return bytes([0xFF if value < 0 else 0x80]) + (value % 256**11).to_bytes(11, "big")


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (_raw_header("top/a", _base256(-5)), "negative size"),
        (_raw_header("././@LongLink", _base256(-1000), tarfile.GNUTYPE_LONGNAME), "negative"),
        (_raw_header("././@LongLink", _base256(2**80), tarfile.GNUTYPE_LONGNAME), "extended"),
        (_raw_header("pax", b"%011o\x00" % (2**30), tarfile.XHDTYPE), "extended header of"),
    ],
    ids=["negative member", "negative long name", "huge long name", "huge pax header"],
)
def test_impossible_header_sizes_are_a_bad_source(
    tmp_path: Path, header: bytes, reason: str
) -> None:
    # Refused at the header: nothing is allocated for a size the archive cannot hold.
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(gzip.compress(header + bytes(1024)))
    with pytest.raises(BadSourceError, match=reason):
        list(iter_members(archive, {"top/a"}))


def _extended(kind: bytes, payload: bytes) -> bytes:
    header = _raw_header("././@LongLink", b"%011o\x00" % len(payload), kind)
    return header + payload + bytes(-len(payload) % tarfile.BLOCKSIZE)


def _pax(**records: str) -> bytes:
    body = b""
    for key, value in records.items():
        text = f" {key}={value}\n".encode()
        length = len(text) + 1
        length = len(text) + len(str(length))
        body += str(length).encode() + text
    return body


_A = _raw_header("top/a", b"%011o\x00" % 1) + b"A" + bytes(511)


@pytest.mark.parametrize(
    "prefix",
    [
        _extended(tarfile.GNUTYPE_LONGNAME, b"../evil\x00")
        + _extended(tarfile.XHDTYPE, _pax(path="top/safe")),
        _extended(tarfile.XGLTYPE, _pax(path="../evil"))
        + _extended(tarfile.XHDTYPE, _pax(mtime="1")),
        _extended(tarfile.XHDTYPE, _pax(path="../evil"))
        + _extended(tarfile.XHDTYPE, _pax(mtime="1")),
        _extended(tarfile.XHDTYPE, _pax(linkpath="/etc/passwd")),
    ],
    ids=["long name under pax", "global path", "stacked pax", "pax linkpath"],
)
def test_every_name_an_extended_header_gives_is_checked(tmp_path: Path, prefix: bytes) -> None:
    # Whichever header a reader would take the name from, a `..` or absolute name anywhere
    # refuses the archive (tarfile names these members `../evil`).
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(gzip.compress(prefix + _A + bytes(1024)))
    with pytest.raises(BadSourceError):
        list(iter_members(archive, {"top/a", "top/safe"}))


def test_global_pax_records_apply_to_later_members(tmp_path: Path) -> None:
    archive = tmp_path / "g.tar.gz"
    body = _extended(tarfile.XGLTYPE, _pax(comment="made by hand")) + _A
    body += _extended(tarfile.XHDTYPE, _pax(path="top/" + "long" * 40)) + _A
    archive.write_bytes(gzip.compress(body + bytes(1024)))
    names = {"top/a", "top/" + "long" * 40}
    got = {name: f.read() for name, f in iter_members(archive, names)}
    assert got == _tarfile_reads(archive, names) == dict.fromkeys(names, b"A")


def test_global_pax_records_cost_nothing_per_member(tmp_path: Path) -> None:
    """A hostile archive: a global header of 60,000 records, then 3,000 members. Records the
    parser does not act on are dropped as read; they were copied and scanned for every member
    (20 s and growing with either count before; tarfile takes longer still)."""
    import time

    records = b"".join(_pax(**{f"k{i:06d}": ""}) for i in range(60_000))
    member = _raw_header("top/a", b"%011o\x00" % 0)
    archive = tmp_path / "g.tar.gz"
    archive.write_bytes(
        gzip.compress(_extended(tarfile.XGLTYPE, records) + member * 3_000 + bytes(1024))
    )
    start = time.monotonic()
    got = [name for name, _ in iter_members(archive, {"top/a"})]
    assert got == ["top/a"] * 3_000
    assert time.monotonic() - start < 5.0  # ~0.2 s now


def test_a_pax_sparse_member_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "s.tar.gz"
    sparse = _extended(
        tarfile.XHDTYPE, _pax(**{"GNU.sparse.major": "1", "GNU.sparse.name": "top/a"})
    )
    archive.write_bytes(gzip.compress(sparse + _A + bytes(1024)))
    with pytest.raises(BadSourceError, match="sparse"):
        list(iter_members(archive, {"top/a"}))


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_mutated_archives_read_or_fail_as_bad_sources(tmp_path: Path, mode: str) -> None:
    # A stranger's damaged or crafted archive: whatever its bytes, reading it either gives members
    # or raises BadSourceError (UnsafeArchiveError included); nothing else, and it always ends.
    files = {"top/a": b"A" * 700, _LONG: b"long", "top/b": bytes(range(256)) * 3}
    fmt = tarfile.PAX_FORMAT
    clean = _archive(tmp_path / "clean.tar", mode, fmt, files).read_bytes()
    rng = np.random.default_rng(0)
    victim = tmp_path / "mutated.tar"
    for _ in range(150):
        data = bytearray(clean)
        for _ in range(int(rng.integers(1, 4))):
            at, n = int(rng.integers(0, len(data))), int(rng.integers(1, 9))
            data[at : at + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if rng.random() < 0.2:
            data = data[: int(rng.integers(0, len(data)))]
        victim.write_bytes(bytes(data))
        try:
            for _, f in iter_members(victim, set(files)):
                f.read()
        except BadSourceError:
            pass
