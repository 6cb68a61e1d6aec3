"""Other tools' shards as they come: gzip-compressed tars, `.gz` components, webdataset's key
rules, image sizes from headers, image-less splits and class-ordered tars, each through
`fastdata index` and the DataModule with every field equal to what was written."""

from __future__ import annotations

import gzip
import io
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.write.foreign import ForeignTarError
from fastdata.write.index import IndexingError, index_shards
from tests.write.index.conftest import sha256s, wds


def pattern(i: int, size: int = 28) -> np.ndarray:
    """Sample i's image: a lossless (PNG) pattern whose first pixel names i."""
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    pixels[0, 0] = (i, 255 - i, 7)
    return pixels


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _epoch(out: Path, backend: str = "cpu", **kwargs) -> list:
    dm = ShardDataModule(
        out,
        batch_size=4,
        backend=backend,
        drop_last=False,
        workers=WorkerSettings(num_workers=0),
        **kwargs,
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    dm.teardown()
    return batches


def test_tgz_shards_are_inflated_into_out_and_read_exactly(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    n = 11
    with wds.ShardWriter(str(src / "train-%06d.tgz"), maxcount=4, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"s{i:04d}", "png": png(pattern(i)), "cls": str(i % 3)})
    with wds.TarWriter(str(src / "val-000000.tar.gz")) as sink:  # the other spelling
        for i in range(n, n + 3):
            sink.write({"__key__": f"s{i:04d}", "png": png(pattern(i)), "cls": str(i % 3)})
    assert (src / "train-000000.tgz").read_bytes()[:2] == b"\x1f\x8b"  # really gzip
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    manifest = index_shards(src, tmp_path / "out")
    assert manifest.data_root is None  # the tars are read from OUT, where their copies are
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == [
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
        "val-000000.tar",
    ]
    assert not list((tmp_path / "out").glob("*.tmp-*"))
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # SOURCE untouched
    shard = manifest.split("train").shards[0]
    assert (tmp_path / "out" / shard.name).read_bytes() == gzip.decompress(
        (src / "train-000000.tgz").read_bytes()
    )
    seen = {}
    for x, y in _epoch(tmp_path / "out", train_transforms="none"):
        assert x.shape[1:] == (3, 28, 28)  # 28x28 images keep their size
        for image, label in zip(x, y, strict=True):
            i = int(image[0, 0, 0])
            assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(pattern(i)))
            assert int(label) == i % 3
            seen[i] = seen.get(i, 0) + 1
    assert seen == {i: 1 for i in range(n)}
    assert "inflated" in manifest.source and manifest.source["inflated"] == 4


def test_tgz_indexed_in_place_twice(tmp_path):
    """In place, the copy lands beside its .tgz; a second run indexes the .tgz again rather
    than refusing the copy as a second shard of the same name."""
    with wds.ShardWriter(str(tmp_path / "train-%06d.tgz"), maxcount=4, verbose=0) as sink:
        for i in range(6):
            sink.write({"__key__": f"s{i:04d}", "png": png(pattern(i)), "cls": str(i % 2)})
    first = index_shards(tmp_path)
    second = index_shards(tmp_path)
    assert [s.sha256 for s in second.split("train").shards] == [
        s.sha256 for s in first.split("train").shards
    ]
    assert second.split("train").num_samples == 6


def test_a_truncated_tgz_is_named_and_leaves_nothing_in_out(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with wds.ShardWriter(str(src / "train-%06d.tgz"), maxcount=4, verbose=0) as sink:
        for i in range(8):
            sink.write({"__key__": f"s{i:04d}", "png": png(pattern(i)), "cls": "0"})
    bad = src / "train-000001.tgz"
    bad.write_bytes(bad.read_bytes()[:-300])
    out = tmp_path / "out"
    with pytest.raises(IndexingError, match="train-000001.tgz.*gzip"):
        index_shards(src, out, _one_worker())
    assert sorted(p.name for p in out.rglob("*")) == []  # no copy, temporary or manifest


def test_compressed_and_plain_tars_mixed_outside_out_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("train-000000.tar", "train-000001.tgz"):
        with wds.TarWriter(str(src / name)) as sink:
            sink.write({"__key__": name[:12], "png": png(pattern(1)), "cls": "0"})
    with pytest.raises(IndexingError, match="mixes gzip-compressed tars"):
        index_shards(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def _one_worker():
    from fastdata.write.index import IndexOptions

    return IndexOptions(workers=1)


def features(i: int) -> np.ndarray:
    return (np.arange(6, dtype=np.float32) * (i + 1)).reshape(2, 3)


def _gz_sample(i: int, image: bool) -> dict:
    sample = {
        "__key__": f"clip.v2/{i:05d}",  # a dotted folder in the key
        "txt.gz": f"caption n\u00b0{i}",
        "json.gz": {"id": i, "tags": ["a", str(i)]},
        "npy.gz": features(i),
        "cls.gz" if not image else "cls": str(i % 4),
    }
    if image:
        sample["png"] = png(pattern(i, 12))
    return sample


@pytest.mark.parametrize("backend", ["cpu", "memory"])
@pytest.mark.parametrize("image", [False, True], ids=["image-less", "with-image"])
def test_gz_components_and_image_less_splits_round_trip(tmp_path, backend, image):
    src = tmp_path / "src"
    src.mkdir()
    n = 9
    with wds.ShardWriter(str(src / "train-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(n):
            sink.write(_gz_sample(i, image))
    manifest = index_shards(src, tmp_path / "out")
    kinds = {k: f.kind for k, f in manifest.split("train").field_specs.items()}
    expected = {"text": "text", "json": "json", "array": "array", "label": "label"}
    assert kinds == ({**expected, "image": "image"} if image else expected)
    seen = {}
    for batch in _epoch(tmp_path / "out", backend, train_transforms="none"):
        assert isinstance(batch, dict)
        for row in range(len(batch["text"])):
            i = batch["json"][row]["id"]
            assert batch["text"][row] == f"caption n\u00b0{i}"
            assert batch["json"][row] == {"id": i, "tags": ["a", str(i)]}
            assert torch.equal(batch["array"][row].cpu(), torch.from_numpy(features(i)))
            assert int(batch["label"][row]) == i % 4
            if image:
                assert torch.equal(
                    batch["image"][row].cpu().permute(1, 2, 0), torch.from_numpy(pattern(i, 12))
                )
            seen[i] = seen.get(i, 0) + 1
    assert seen == {i: 1 for i in range(n)}


@pytest.mark.parametrize(
    "backend",
    [
        "dali",
        pytest.param(  # without a GPU it is refused for that first
            "nvjpeg", marks=pytest.mark.gpu
        ),
    ],
)
def test_image_less_split_is_refused_by_image_backends_naming_those_that_can(tmp_path, backend):
    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "train-000000.tar")) as sink:
        for i in range(3):
            sink.write(_gz_sample(i, image=False))
    index_shards(src, tmp_path / "out")
    dm = ShardDataModule(
        tmp_path / "out", batch_size=2, backend=backend, workers=WorkerSettings(num_workers=0)
    )
    with pytest.raises(ValueError, match="'cpu' or 'memory'"):
        dm.setup("fit")


def test_a_gz_component_bomb_is_named_at_index_time(tmp_path, monkeypatch):
    import fastdata.format.fields

    monkeypatch.setattr(fastdata.format.fields, "MAX_INFLATED_BYTES", 1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "train-000000.tar")) as sink:
        sink.write({"__key__": "ok", "txt.gz": "fine", "cls": "0"})
        sink.write({"__key__": "bomb", "txt.gz": b"\0" * (4 << 20), "cls": "0"})
    with pytest.raises(
        ForeignTarError, match=r"train-000000.tar: sample 'bomb'.*more than 1048576"
    ):
        index_shards(src, tmp_path / "out", _one_worker())
    assert not (tmp_path / "out" / "manifest.json").exists()


def _raw_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_keys_are_grouped_as_webdataset_groups_them(tmp_path):
    """Dotted folders, dotted components, folders in member names, upper-case extensions and
    webdataset's `__meta__` members: the samples and components `fastdata index` finds are the
    ones `webdataset.WebDataset` yields, and each sample's fields come back as written."""
    src = tmp_path / "src"
    src.mkdir()
    members = [("__meta__", b"written by a tool")]
    for i in range(6):
        folder = f"set.v{i % 2}/sub.dir"
        members += [
            (f"{folder}/img{i}.left.TXT", f"left {i}".encode()),  # component 'left.txt'
            (f"{folder}/img{i}.txt", f"caption {i}".encode()),
            (f"{folder}/img{i}.seg.json", f'{{"i": {i}}}'.encode()),  # not a known field
            (f"{folder}/img{i}.cls", str(i).encode()),
        ]
    _raw_tar(src / "train-000000.tar", members)
    oracle = [
        (s["__key__"], sorted(k for k in s if not k.startswith("__")))
        for s in wds.WebDataset(str(src / "train-000000.tar"), shardshuffle=False)
    ]
    manifest = index_shards(src, tmp_path / "out")
    index = (tmp_path / "out" / "train-000000.idx").read_text().splitlines()[1:]
    found = []
    for line in index:
        tokens = line.split()
        comps = sorted(tokens[0::4][i].lower() for i in range(len(tokens) // 4))
        key = tokens[3].rsplit("/", 1)[0] + "/" + tokens[3].rsplit("/", 1)[1].split(".")[0]
        found.append((key, comps))
    assert found == oracle
    assert oracle[0] == ("set.v0/sub.dir/img0", ["cls", "left.txt", "seg.json", "txt"])
    assert sorted(manifest.split("train").field_specs) == ["label", "text"]
    texts = {}
    for batch in _epoch(tmp_path / "out"):
        for text, label in zip(batch["text"], batch["label"], strict=True):
            texts[int(label)] = text
    assert texts == {i: f"caption {i}" for i in range(6)}


def test_upper_case_image_components_in_a_classification_split_are_refused_clearly(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _raw_tar(src / "train-000000.tar", [("a.JPG", png(pattern(1))), ("a.cls", b"0")])
    with pytest.raises(IndexingError, match=r"\['JPG'\].*lower case"):
        index_shards(src, tmp_path / "out")


def test_small_foreign_images_keep_their_native_size_by_default(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with wds.ShardWriter(str(src / "train-%06d.tar"), maxcount=8, verbose=0) as sink:
        for i in range(8):
            sink.write({"__key__": f"{i:04d}", "png": png(pattern(i)), "cls": str(i % 2)})
    manifest = index_shards(src, tmp_path / "out")
    info = manifest.split("train")
    assert info.raw_shape == [28, 28, 3]
    assert info.image_stats["max_width"] == 28 and info.image_stats["mean_height"] == 28
    dm = ShardDataModule(
        tmp_path / "out", batch_size=4, backend="cpu", workers=WorkerSettings(num_workers=0)
    )
    assert dm.image_shape == (3, 28, 28)  # not upsampled to 224
    dm.setup("fit")
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape[1:] == (3, 28, 28)
    dm.teardown()


def test_varying_image_sizes_are_recorded_without_a_raw_shape(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "train-000000.tar")) as sink:
        for i, side in enumerate((20, 30, 40)):
            sink.write({"__key__": f"{i}", "png": png(pattern(i, side)), "cls": "0"})
    info = index_shards(src, tmp_path / "out").split("train")
    assert info.raw_shape is None
    assert (info.image_stats["min_height"], info.image_stats["max_height"]) == (20, 40)
    assert info.image_stats["mean_width"] == 30


def _class_shards(folder: Path, ordered: bool) -> None:
    labels = [c for c in range(10) for _ in range(20)]  # 200 samples, 20 per class
    if not ordered:
        labels = list(np.random.default_rng(0).permutation(labels))
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=25, verbose=0) as sink:
        for i, label in enumerate(labels):
            sink.write({"__key__": f"{i:05d}", "txt": f"s{i}", "cls": str(label)})


@pytest.mark.parametrize("ordered", [True, False], ids=["class-ordered", "shuffled"])
def test_ordered_labels_are_reported(tmp_path, caplog, capsys, ordered):
    from fastdata.cli import main

    src = tmp_path / "src"
    src.mkdir()
    _class_shards(src, ordered)
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        assert main(["index", str(src), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    order = load_manifest(tmp_path / "out").source["label_order"]["train"]
    warned = [r for r in caplog.records if "look ordered" in r.getMessage()]
    if ordered:
        assert order > 0.9 and len(warned) == 1 and "(ordered" in printed
        assert "shuffle='window'" in warned[0].getMessage()  # names the option that mixes
    else:
        assert order < 0.2 and not warned and "(ordered" not in printed
    assert f"label_order {order:.2f}" in printed


def test_source_tars_are_not_changed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _class_shards(src, True)
    before = sha256s(src)
    index_shards(src, tmp_path / "out")
    assert sha256s(src) == before


def test_tgz_shards_over_http_are_inflated_into_out(tmp_path):
    pytest.importorskip("aiohttp")
    from tests.remote.servers import FileServer

    src = tmp_path / "src"
    src.mkdir()
    with wds.ShardWriter(str(src / "train-%06d.tgz"), maxcount=4, verbose=0) as sink:
        for i in range(7):
            sink.write({"__key__": f"s{i:04d}", "txt.gz": f"t{i}", "cls": str(i % 2)})
    server = FileServer(src)
    try:
        pattern_url = f"{server.url}/train-{{000000..000001}}.tgz"
        manifest = index_shards(pattern_url, tmp_path / "out")
    finally:
        server.stop()
    assert manifest.data_root is None  # read from OUT's copies: the server can go away
    texts = sorted(t for batch in _epoch(tmp_path / "out") for t in batch["text"])
    assert texts == sorted(f"t{i}" for i in range(7))


def test_ten_members_round_trip_as_webdataset_writes_them(tmp_path):
    """`.ten` (webdataset's tenbin: several arrays a member) through index and both backends."""
    from webdataset import tenbin

    def arrays(i: int) -> list[np.ndarray]:
        return [np.full((2, 3), i, dtype=np.float32), np.arange(i, i + 4, dtype=np.int64)]

    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "train-000000.tar")) as sink:
        for i in range(5):
            ten = bytes(tenbin.encode_buffer(arrays(i)))
            sink.write({"__key__": f"{i:03d}", "ten": ten, "cls": str(i % 2)})
    manifest = index_shards(src, tmp_path / "out")
    assert manifest.split("train").field_specs["tensors"].kind == "tensors"
    for backend in ("cpu", "memory"):
        seen = []
        for batch in _epoch(tmp_path / "out", backend):
            first, second = batch["tensors"]  # one stacked tensor per array of a sample
            for a, b, label in zip(first, second, batch["label"], strict=True):
                i = int(b[0])
                assert torch.equal(a.cpu(), torch.from_numpy(arrays(i)[0]))
                assert torch.equal(b.cpu(), torch.from_numpy(arrays(i)[1]))
                assert int(label) == i % 2
                seen.append(i)
        assert sorted(seen) == list(range(5)), backend


def test_a_ten_header_claiming_more_than_its_bytes_is_refused():
    from fastdata.format.fields import FieldError, FieldSpec
    from fastdata.format.tenbin import encode_tenbin

    good = encode_tenbin([np.zeros((4, 4), dtype=np.float32)])
    forged = bytearray(good)
    forged[16 + 24 : 16 + 32] = (1 << 40).to_bytes(8, "little")  # first dimension: 2**40
    spec = FieldSpec("tensors", "tensors", ("ten",))
    assert spec.decode({"ten": good})[0].shape == (4, 4)
    with pytest.raises(FieldError, match="does not match 64 data bytes"):
        spec.decode({"ten": bytes(forged)})
    with pytest.raises(FieldError, match="magic"):
        spec.decode({"ten": b"garbage!" * 4})


def test_a_killed_runs_inflated_copies_are_removed_by_the_next_run(tmp_path):

    from tests.write.index.test_index_interrupted import _temporaries, run_killed_index

    src = tmp_path / "src"
    src.mkdir()
    with wds.ShardWriter(str(src / "train-%06d.tgz"), maxcount=4, verbose=0) as sink:
        for i in range(8):
            sink.write({"__key__": f"s{i:04d}", "txt": f"t{i}", "cls": str(i % 2)})
    out = tmp_path / "out"
    run_killed_index(src, out)
    left = _temporaries(out)
    assert sorted(n.split(".tmp-")[0] for n in left) == [
        "train-000000.idx",
        "train-000000.sum",
        "train-000000.tar",  # the inflated copies, killed before their rename
        "train-000001.idx",
        "train-000001.sum",
        "train-000001.tar",
    ]
    manifest = index_shards(src, out)
    assert manifest.split("train").num_samples == 8
    assert _temporaries(out) == []


def test_a_hidden_file_in_a_folder_is_refused_where_webdataset_makes_a_folder_key(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _raw_tar(src / "train-000000.tar", [("d/a.txt", b"x"), ("d/a.cls", b"0"), ("d/.DS_Store", b"")])
    with pytest.raises(ForeignTarError, match=r"member 'd/.DS_Store' belongs to no sample"):
        index_shards(src, tmp_path / "out", _one_worker())
