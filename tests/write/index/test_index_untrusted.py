"""`fastdata index` and the readers on untrusted tars and manifests: errors name the tar and the
member, nothing is written on failure, and a manifest's `data_root` cannot lead a reader out."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from fastdata.format.manifest import ManifestError
from fastdata.format.manifest_io import load_manifest, manifest_from_dict
from fastdata.format.schema import label_and_id
from fastdata.read.shardio import ShardReader
from fastdata.write.foreign import ForeignTarError
from fastdata.write.index import IndexOptions, index_shards
from tests.write.index.conftest import sha256s, solid_jpeg


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> Path:
    """A tar of regular members (name, data); a name ending in '/' is a directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
                continue
            info.size, info.mtime, info.mode = len(data), time.time(), 0o600
            info.uname, info.gname, info.uid, info.gid = "alice", "staff", 1000, 20
            tar.addfile(info, io.BytesIO(data))
    return path


def _samples(n: int, prefix: str = "") -> list[tuple[str, bytes]]:
    return [
        m
        for i in range(n)
        for m in ((f"{prefix}{i:04d}.cls", b"%d" % i), (f"{prefix}{i:04d}.jpg", solid_jpeg(i)))
    ]


@pytest.mark.parametrize(
    ("member", "pattern"),
    [
        ("README", r"member 'README' belongs to no sample"),
        ("../0009.jpg", r"member '../0009.jpg' has a path that leaves the archive"),
        ("/abs/0009.jpg", r"member '/abs/0009.jpg' has a path that leaves the archive"),
        ("a b/0009.jpg", r"member 'a b/0009.jpg' has whitespace"),
        ("0001.jpg", r"member '0001.jpg': sample '0001' holds component 'jpg' twice"),
    ],
)
def test_bad_members_name_the_tar_and_member(tmp_path: Path, member: str, pattern: str) -> None:
    members = _samples(2)
    members.insert(4 if member == "0001.jpg" else 2, (member, b"x"))
    _tar(tmp_path / "wds" / "train-000000.tar", members)
    out = tmp_path / "out"
    with pytest.raises(ForeignTarError, match=r"train-000000.tar: " + pattern):
        index_shards(tmp_path / "wds", out)
    assert not out.exists()  # nothing written


def test_link_member_is_refused(tmp_path: Path) -> None:
    path = _tar(tmp_path / "wds" / "train-000000.tar", _samples(1))
    with tarfile.open(path, "a") as tar:
        link = tarfile.TarInfo("0001.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ForeignTarError, match=r"train-000000.tar: member '0001.jpg' is a link"):
        index_shards(tmp_path / "wds", tmp_path / "out")


@pytest.mark.parametrize("cut", ["in a member", "at a member's end"])
def test_truncated_tar_names_tar_and_member(tmp_path: Path, cut: str) -> None:
    path = _tar(tmp_path / "wds" / "train-000000.tar", _samples(3))
    index_shards(tmp_path / "wds", tmp_path / "whole")  # the whole tar indexes
    lines = (tmp_path / "whole" / "train-000000.idx").read_text().splitlines()
    last = lines[-1].split()  # sample 0002: cls, jpg
    jpg_offset, jpg_size = int(last[5]), int(last[6])
    end = jpg_offset + jpg_size + (-jpg_size % 512)
    data = path.read_bytes()
    path.write_bytes(data[: jpg_offset + 100] if cut == "in a member" else data[:end])
    out = tmp_path / "out"
    with pytest.raises(ForeignTarError, match=r"train-000000.tar: .*after member '0002.jpg'"):
        index_shards(tmp_path / "wds", out)
    assert not out.exists()


def test_any_writers_headers_are_read(tmp_path: Path) -> None:
    """GNU long names, PAX long and non-ASCII names, user names, modes, directories: indexed,
    then read with every check (header, label, digest)."""
    long_dir = "d" * 60 + "/" + "e.f" * 20 + "/"
    gnu = [("dir.x/", b"")] + [(long_dir + n, d) for n, d in _samples(3, "key-")]
    pax = [(f"caf\u00e9/{n}", d) for n, d in _samples(2)] + [(long_dir + "9999.cls", b"1")]
    pax += [(long_dir + "9999.jpg", solid_jpeg(1))]
    _tar(tmp_path / "wds" / "train-000000.tar", gnu, tarfile.GNU_FORMAT)
    _tar(tmp_path / "wds" / "train-000001.tar", pax, tarfile.PAX_FORMAT)
    before = sha256s(tmp_path / "wds")
    manifest = index_shards(tmp_path / "wds", tmp_path / "out")
    assert sha256s(tmp_path / "wds") == before
    reader = ShardReader(manifest, "train", verify_samples=True)
    got = []
    for shard, info in enumerate(manifest.split("train").shards):
        for index in range(info.num_samples):
            parts = reader.sample(shard, index)
            got.append(
                (
                    reader.key(shard, index),
                    label_and_id(reader.key(shard, index), parts, reader.position(shard, index)),
                )
            )
    reader.close()
    assert got == [
        (long_dir + "key-0000", (0, 0)),
        (long_dir + "key-0001", (1, 1)),
        (long_dir + "key-0002", (2, 2)),
        ("caf\u00e9/0000", (0, 3)),
        ("caf\u00e9/0001", (1, 4)),
        (long_dir + "9999", (1, 5)),
    ]


# --------------------------------------------------------------- hostile manifests
def _indexed(tmp_path: Path) -> tuple[Path, Path, dict]:
    _tar(tmp_path / "wds" / "train-000000.tar", _samples(2))
    out = tmp_path / "out"
    index_shards(tmp_path / "wds", out)
    return tmp_path / "wds", out, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize(
    "data_root",
    [
        "relative/wds",
        "/tmp/../etc",
        "/tmp/./x",
        "ftp://host/x",
        "http://host/a/../b",
        "http:///x",
        "https://host/x?sig=1",
        7,
    ],
)
def test_hostile_data_root_is_refused(tmp_path: Path, data_root) -> None:
    _, out, data = _indexed(tmp_path)
    data["data_root"] = data_root
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="data_root"):
        load_manifest(out)


def test_a_served_manifest_cannot_point_at_local_files(tmp_path: Path) -> None:
    wds, _, data = _indexed(tmp_path)
    with pytest.raises(ManifestError, match="may not point at local files"):
        manifest_from_dict(data, root="http://127.0.0.1:9/ds")


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_tar_names_stay_inside_data_root(tmp_path: Path, how: str) -> None:
    wds, out, data = _indexed(tmp_path)
    secret = tmp_path / "secret.tar"
    secret.write_bytes((wds / "train-000000.tar").read_bytes())
    shard = data["splits"]["train"]["shards"][0]
    if how == "dotdot":
        shard["name"] = "../secret.tar"
    else:
        os.symlink(secret, wds / "link.tar")
        shard["name"] = "link.tar"
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="leaves the dataset|outside the dataset folder"):
        load_manifest(out)


@pytest.mark.parametrize("lid_label, size", [(1, 16), (0, 15)])
def test_a_lid_that_disagrees_with_cls_is_refused(tmp_path: Path, lid_label: int, size: int):
    """Readers that take the label from `lid` and those that take it from `cls` must agree: a
    foreign tar whose `lid` says another label (or is not 16 bytes) is refused by name."""
    import numpy as np

    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "train-000000.tar", "w") as tar:
        lid = np.array([lid_label, 7], "<i8").tobytes()[:size]
        for ext, data in (("cls", b"0"), ("jpg", solid_jpeg(0)), ("lid", lid)):
            info = tarfile.TarInfo(f"0000.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ForeignTarError, match=r"train-000000.tar.*'0000'.*'lid'"):
        index_shards(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_webp_shards_are_refused_at_index_time(tmp_path: Path) -> None:
    """The readers cannot decode WebP: say so when indexing, not at every batch."""
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "train-000000.tar", "w") as tar:
        for ext, data in (("cls", b"0"), ("webp", b"RIFF\x00\x00\x00\x00WEBPVP8 ")):
            info = tarfile.TarInfo(f"0000.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(Exception, match="webp"):
        index_shards(src, tmp_path / "out")


def test_brace_products_and_jsonl_columns_are_bounded(tmp_path: Path) -> None:
    from fastdata.write.index import IndexingError, expand_braces
    from fastdata.write.sources.listcolumns import ColumnError, merged_kinds

    with pytest.raises(IndexingError, match="more than"):
        expand_braces("http://h/s-{0..1999}-{0..999}.tar")  # each brace under the cap
    with pytest.raises(ColumnError, match="in all"):
        merged_kinds(({f"k{i}": 1} for i in range(5000)), csv=False)


def test_a_member_over_the_size_bound_is_refused(tmp_path: Path, monkeypatch) -> None:
    import fastdata.write.foreign as foreign

    monkeypatch.setattr(foreign, "MAX_MEMBER_BYTES", 100)  # instead of writing a 1 GiB member
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "train-000000.tar", "w") as tar:
        for ext, data in (("cls", b"0"), ("jpg", solid_jpeg(0))):
            info = tarfile.TarInfo(f"0000.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ForeignTarError, match=r"'0000.jpg' is \d+ bytes, more than"):
        index_shards(src, tmp_path / "out", IndexOptions(workers=1))
