"""`fastdata index` on shards webdataset's ShardWriter wrote: read in place, every guarantee kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import ShardDataModule, WorkerSettings
from fastdata.cli import main
from fastdata.format.manifest_io import load_manifest
from fastdata.read.plan import PAD_LABEL
from fastdata.read.shardio import ShardReader, ShardReadError
from fastdata.write.index import IndexingError, IndexOptions, expand_braces, index_shards
from tests.write.index.conftest import N_TEST, N_TRAIN, caption, colour, meta, sha256s


def _epoch(dm: ShardDataModule, role: str) -> list[tuple[int, tuple[int, ...]]]:
    """(label, centre pixel colour) of every real sample `role`'s loader yields in epoch 0."""
    loader = dm.train_dataloader() if role == "train" else dm.val_dataloader()
    out = []
    for x, y in loader:
        assert x.dtype == torch.uint8 and x.ndim == 4
        h, w = x.shape[2] // 2, x.shape[3] // 2
        for image, label in zip(x, y, strict=True):
            if int(label) != PAD_LABEL:
                out.append((int(label), tuple(int(v) for v in image[:, h, w])))
    return out


def _check_every_sample_once(dm: ShardDataModule, role: str, n: int) -> None:
    got = _epoch(dm, role)
    assert sorted(label for label, _ in got) == list(range(n))  # each sample once
    for label, pixel in got:  # and each label with its own image
        assert np.abs(np.array(pixel) - np.array(colour(label))).max() <= 8, (label, pixel)


def _module(out: Path, **kwargs) -> ShardDataModule:
    options = dict(
        batch_size=5,
        workers=WorkerSettings(num_workers=0),
        backend="cpu",
        verify_samples=True,
        splits={"val": "test"},
    )
    dm = ShardDataModule(out, **{**options, **kwargs})
    dm.setup("fit")
    return dm


def test_cls_shards_read_in_place_with_tars_unchanged(cls_shards: Path, tmp_path: Path) -> None:
    before = sha256s(cls_shards)
    out = tmp_path / "index"
    assert main(["index", str(cls_shards), "--out", str(out)]) == 0
    assert sha256s(cls_shards) == before  # not a byte of a tar rewritten
    assert not list(out.glob("*.tar"))  # the tars stay where they are
    manifest = load_manifest(out)
    assert manifest.data_root == str(cls_shards)
    assert manifest.classes == [str(i) for i in range(N_TRAIN)]
    assert {s: manifest.split(s).num_samples for s in manifest.splits} == {
        "train": N_TRAIN,
        "test": N_TEST,
    }
    assert [s.sha256 for s in manifest.split("train").shards] == [
        before[f"train-{i:06d}.tar"] for i in range(3)
    ]
    dm = _module(out)
    _check_every_sample_once(dm, "train", N_TRAIN)
    _check_every_sample_once(dm, "val", N_TEST)
    assert sha256s(cls_shards) == before


def test_in_place_when_the_folder_is_writable(cls_shards: Path) -> None:
    manifest = index_shards(cls_shards)
    assert manifest.data_root is None and Path(manifest.root) == cls_shards
    assert (cls_shards / "train-000000.idx").is_file() and (
        cls_shards / "train-000000.sum"
    ).exists()
    assert "data_root" not in json.loads((cls_shards / "manifest.json").read_text())
    _check_every_sample_once(_module(cls_shards), "train", N_TRAIN)


def test_caption_shards_fields_arrive_unchanged(caption_shards: Path, tmp_path: Path) -> None:
    before = sha256s(caption_shards)
    manifest = index_shards(caption_shards, tmp_path / "out")
    assert sha256s(caption_shards) == before
    split = manifest.split("train")  # one file-name prefix that names no split: train
    assert {n: (f.kind, f.components) for n, f in split.field_specs.items()} == {
        "image": ("image", ("jpg",)),
        "json": ("json", ("json",)),
        "text": ("text", ("txt",)),
    }
    assert manifest.classes == [] and split.num_samples == 10
    specs = split.field_specs
    reader = ShardReader(manifest, "train", verify_samples=True)
    seen = []
    for shard, info in enumerate(split.shards):
        for index in range(info.num_samples):
            parts = reader.sample(shard, index)
            number = int(reader.key(shard, index))
            assert specs["json"].decode(parts) == meta(number)
            assert specs["text"].decode(parts) == caption(number)
            assert bytes(specs["image"].decode(parts))[:2] == b"\xff\xd8"
            assert reader.position(shard, index) == len(seen)
            seen.append(number)
    reader.close()
    assert seen == list(range(10))


def test_over_http_brace_pattern_and_list_file(cls_shards: Path, tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from tests.remote.servers import FileServer

    before = sha256s(cls_shards)
    server = FileServer(cls_shards)
    try:
        out = tmp_path / "over-http"
        pattern = f"{server.url}/{{train,test}}-{{000000..000001}}.tar"
        listed = tmp_path / "urls.txt"
        listed.write_text(f"{server.url}/train-000002.tar\n")
        index_shards(pattern, out)  # 4 of the 5 tars...
        with pytest.raises(IndexingError, match="--out"):
            index_shards(pattern)  # a URL needs --out
        with pytest.raises(IndexingError, match=r"/train-000009.tar: no such object"):
            index_shards(f"{server.url}/train-00000{{2,9}}.tar", tmp_path / "none")
        assert not (tmp_path / "none").exists()
        manifest = index_shards(listed, tmp_path / "one")  # ...and a list file
        assert manifest.data_root == server.url and manifest.split("train").num_samples == 6
        full = tmp_path / "all"
        (tmp_path / "all.txt").write_text("".join(f"{server.url}/{n}\n" for n in sorted(before)))
        manifest = index_shards(tmp_path / "all.txt", full)
        assert manifest.shard_url(manifest.split("train").shards[0]).startswith("http://")
        dm = _module(full)
        _check_every_sample_once(dm, "train", N_TRAIN)
        _check_every_sample_once(dm, "val", N_TEST)
    finally:
        server.stop()
    assert sha256s(cls_shards) == before


def test_brace_expansion() -> None:
    assert expand_braces("s-{008..010}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar"]
    assert expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    with pytest.raises(IndexingError, match="range"):
        expand_braces("s-{9..1}.tar")


def test_split_patterns_and_classes_file(cls_shards: Path, tmp_path: Path) -> None:
    classes = tmp_path / "classes.txt"
    classes.write_text("".join(f"name{i}\n" for i in range(N_TRAIN)))
    opts = IndexOptions(splits={"fit": "train-00000[01].tar", "holdout": "test-*"}, classes=None)
    manifest = index_shards(cls_shards, tmp_path / "a", opts)
    assert sorted(manifest.splits) == ["fit", "holdout"]
    assert manifest.split("fit").num_samples == 14  # train-000002.tar matches no pattern
    assert (
        main(["index", str(cls_shards), "--out", str(tmp_path / "b"), "--classes", str(classes)])
        == 0
    )
    assert load_manifest(tmp_path / "b").classes[3] == "name3"
    classes.write_text("only\ntwo\n")
    with pytest.raises(IndexingError, match=r"test-000000.tar: sample '000002' has 'cls' 2"):
        index_shards(cls_shards, tmp_path / "c", IndexOptions(classes=["only", "two"]))
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_tampered_sample_and_label_are_caught(cls_shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = index_shards(cls_shards, out, IndexOptions(splits={"test": "test-*"}))
    assert len(manifest.classes) == N_TEST  # cls values 0..8
    shard = manifest.split("test").shards[0]
    tar = cls_shards / shard.name
    entries = (out / shard.index).read_text().splitlines()[1:]
    fields = entries[1].split()  # sample 000001: cls, then jpg
    assert fields[0] == "cls" and fields[4] == "jpg"
    cls_offset, jpg_offset = int(fields[1]), int(fields[5])
    data = bytearray(tar.read_bytes())
    data[jpg_offset + 200] ^= 0xFF  # a flipped image byte: only the digest can see it
    tar.write_bytes(bytes(data))
    reader = ShardReader(load_manifest(out), "test", verify_samples=True)
    with pytest.raises(ShardReadError, match=r"test-000000.tar, sample '000001'.*digest"):
        reader.sample(0, 1)
    reader.close()
    data[cls_offset] = ord("9")  # label 1 -> 9: outside the 9 classes
    tar.write_bytes(bytes(data))
    reader = ShardReader(load_manifest(out), "test")
    reader.sample(0, 0)
    with pytest.raises(ShardReadError, match=r"sample '000001'.*'cls' label 9 is outside"):
        reader.sample(0, 1)
    reader.close()


def test_flaky_and_failing_servers(cls_shards: Path, tmp_path: Path) -> None:
    """Cut bodies, resets and 503s are retried from the tar's start (the result is the tars'
    own sha256); a tar that keeps failing names its URL and leaves OUT without a file."""
    pytest.importorskip("aiohttp")
    from fastdata.remote import RemoteError, RetryPolicy
    from tests.remote.servers import FaultPlan, FaultProxy, FileServer

    before = sha256s(cls_shards)
    server = FileServer(cls_shards)
    fast = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.05)
    try:
        plan = FaultPlan(every_503=4, every_short=3, resets=frozenset({2}))
        proxy = FaultProxy(server.url, plan)
        try:
            opts = IndexOptions(retry=fast, workers=1)
            manifest = index_shards(
                f"{proxy.url}/train-{{000000..000002}}.tar", tmp_path / "a", opts
            )
            assert min(plan.injected[f] for f in ("503", "short", "reset")) >= 1  # all met
        finally:
            proxy.stop()
        assert [s.sha256 for s in manifest.split("train").shards] == [
            before[f"train-{i:06d}.tar"] for i in range(3)
        ]
        proxy = FaultProxy(server.url, FaultPlan(fail_paths=frozenset({"/train-000001.tar"})))
        out = tmp_path / "b"
        try:
            pattern = f"{proxy.url}/train-{{000000..000002}}.tar"
            with pytest.raises(RemoteError, match=r"train-000001.tar"):
                index_shards(pattern, out, IndexOptions(retry=fast, workers=2))
        finally:
            proxy.stop()
        assert not out.exists()  # nothing half-written
    finally:
        server.stop()
