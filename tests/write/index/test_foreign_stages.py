"""The stages of `scan_tar`, each alone: members -> samples -> checked -> digested -> index."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from fastdata.format.schema import sample_digest
from fastdata.write.foreign import (
    ForeignTarError,
    Member,
    Sample,
    TarPosition,
    check_samples,
    digest_samples,
    group_by_key,
    index_rows,
    scan_tar,
    tar_members,
)
from fastdata.write.tarstream import HashingReader
from tests.write.index.conftest import solid_jpeg


def _tar_bytes(members: list[tuple[str, bytes | None]]) -> bytes:
    """A tar of (name, data) members; data None: a folder."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _members(data: bytes) -> tuple[list[Member], TarPosition]:
    reader = HashingReader(io.BytesIO(data))
    position = TarPosition()
    with tarfile.open(fileobj=io.BufferedReader(reader), mode="r|") as tar:
        return list(tar_members(tar, reader, "t.tar", position)), position


def _member(name: str, data: bytes = b"x") -> Member:
    key, ext = name.split(".", 1)
    return Member(name, key, ext, 512, len(data), data)


def test_tar_members_pass_over_folders_and_metadata_and_give_offsets():
    data = _tar_bytes([("__meta__", b"tool"), ("d", None), ("d/a.cls", b"1"), ("d/a.txt", b"hi")])
    members, position = _members(data)
    assert [(m.key, m.component, m.data) for m in members] == [
        ("d/a", "cls", b"1"),
        ("d/a", "txt", b"hi"),
    ]
    for m in members:  # the offset is where the member's bytes are in the tar
        assert data[m.offset : m.offset + m.size] == m.data
    assert position.last_member == "d/a.txt" and position.end == members[-1].offset + 512


def test_tar_members_refuse_a_link_naming_it():
    buffer = io.BytesIO(_tar_bytes([("a.cls", b"1")])[:-1024])  # without the end blocks
    with tarfile.open(fileobj=buffer, mode="a") as tar:
        link = tarfile.TarInfo("a.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ForeignTarError, match=r"t.tar: member 'a.jpg' is a link"):
        _members(buffer.getvalue())


def test_group_by_key_groups_consecutive_members_and_refuses_a_component_twice():
    members = [_member("a.cls"), _member("a.jpg"), _member("b.cls"), _member("a.txt")]
    samples = list(group_by_key(members, "t.tar"))
    assert [(s.key, [m.component for m in s.members]) for s in samples] == [
        ("a", ["cls", "jpg"]),
        ("b", ["cls"]),
        ("a", ["txt"]),  # webdataset groups consecutive members only, as this does
    ]
    twice = group_by_key([_member("a.jpg"), _member("a.JPG")], "t.tar")
    with pytest.raises(ForeignTarError, match=r"sample 'a' holds component 'JPG' twice"):
        list(twice)


def test_check_samples_reads_labels_sizes_and_inflates_gz():
    jpeg = solid_jpeg(3)
    sample = Sample("a", [_member("a.cls.gz", gzip.compress(b"7")), _member("a.jpg", jpeg)])
    (checked,) = check_samples([sample], "t.tar")
    assert checked.label == 7 and checked.size is not None
    bad = Sample("b", [_member("b.cls", b"cat")])
    with pytest.raises(ForeignTarError, match=r"t.tar: sample 'b' has 'cls' b'cat'"):
        list(check_samples([bad], "t.tar"))
    bomb = Sample("c", [_member("c.txt.gz", b"not gzip")])
    with pytest.raises(ForeignTarError, match=r"t.tar: sample 'c': component 'txt.gz'"):
        list(check_samples([bomb], "t.tar"))


def test_digest_and_index_rows():
    sample = Sample("a", [_member("a.cls", b"1"), _member("a.txt", b"hi")], label=1)
    (digested,) = digest_samples([sample])
    assert digested.digest == sample_digest({"cls": b"1", "txt": b"hi"})
    out = index_rows([digested], "t.tar")
    assert out.index_text == "v1.2 1\ncls 512 1 a.cls txt 512 2 a.txt\n"
    assert out.keys == ["a"] and out.labels == [1] and out.components == [("cls", "txt")]


def test_the_stages_compose_into_scan_tar():
    data = _tar_bytes([("a.cls", b"1"), ("a.txt", b"hi"), ("b.cls", b"2")])
    out = scan_tar(io.BytesIO(data), "t.tar")
    members, _ = _members(data)
    by_stages = index_rows(digest_samples(check_samples(group_by_key(members, "t"), "t")), "t.tar")
    assert (out.index_text, out.sums_text) == (by_stages.index_text, by_stages.sums_text)
    assert out.bytes == len(data) and out.keys == ["a", "b"]
