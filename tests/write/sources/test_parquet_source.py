"""Parquet files, written by pyarrow alone and by `datasets`, through `fastdata shard parquet`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.cli import main
from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, FolderSource, ParquetSource, open_source
from fastdata.write.writer import WORK_DIR
from tests.conftest import write_jpeg_folder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ZOO = ["zebra", "ant", "moose"]  # deliberately unsorted: the metadata's order must be kept


def _pixels(i: int) -> np.ndarray:
    """A 12x16 image unique to row i."""
    pixels = np.zeros((12, 16, 3), np.uint8)
    pixels[:, :] = ((i * 37) % 256, 255 - (i * 11) % 256, 40)
    pixels[2:7, i % 12 : i % 12 + 4] = (250, 250, i)
    return pixels


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _plain_dataset(root: Path) -> dict[int, dict[str, Any]]:
    """pyarrow alone: split folders, a binary image column, string labels, other columns."""
    written = {}
    for split, rows in (("train", range(0, 11)), ("val", range(11, 16))):
        table = {
            "png": [_png(_pixels(i)) for i in rows],
            "label": [["cat", "dog", "emu"][i % 3] for i in rows],
            "caption": [f"row {i}" if i % 4 else None for i in rows],
            "row": list(rows),
            "score": [i / 4 for i in rows],
            "tags": [[f"t{i}"] * (i % 3) for i in rows],
        }
        (root / split).mkdir(parents=True)
        pq.write_table(pa.table(table), root / split / "part.parquet", row_group_size=3)
        for i in rows:
            written[i] = {
                "split": split,
                "label": ["cat", "dog", "emu"].index(table["label"][i - rows[0]]),
                "caption": f"row {i}" if i % 4 else "",
                "score": i / 4,
                "tags": [f"t{i}"] * (i % 3),
            }
    return written


def _hf_dataset(root: Path) -> dict[int, dict[str, Any]]:
    """The Hub's layout, written by `datasets`: data/<split>-0000i-of-0000n.parquet."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=ZOO),
            "text": datasets.Value("string"),
            "row": datasets.Value("int32"),
        }
    )
    written = {}
    files = {"train": [range(0, 7), range(7, 12)], "test": [range(12, 16)]}
    for split, chunks in files.items():
        for number, rows in enumerate(chunks):
            data = {
                "image": [{"bytes": _png(_pixels(i)), "path": f"{i}.png"} for i in rows],
                "label": [i % 3 for i in rows],
                "text": [f"a {ZOO[i % 3]} number {i}" for i in rows],
                "row": list(rows),
            }
            name = f"{split}-{number:05d}-of-{len(chunks):05d}.parquet"
            dataset = datasets.Dataset.from_dict(data, features=features)
            dataset.to_parquet(str(root / "data" / name), batch_size=3)  # row groups of 3
            for i in rows:
                written[i] = {"split": split, "label": i % 3, "text": data["text"][i - rows[0]]}
    return written


def _loaded(out: Path, split: str) -> dict[int, dict[str, Any]]:
    """row -> every field of the samples a ShardDataModule yields from `split` (cpu backend)."""
    dm = ShardDataModule(
        out,
        batch_size=4,
        backend="cpu",
        train_transforms="none",
        eval_transforms="none",
        drop_last=False,
        splits={"val": split} if split != "train" else None,
        workers=WorkerSettings(num_workers=0),
    )
    dm.setup("fit")
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    found: dict[int, dict[str, Any]] = {}
    for batch in loader:
        for j, row in enumerate(batch["row"]):
            assert row not in found, f"row {row} yielded twice"
            found[row] = {
                k: (v[j] if isinstance(v, list) else v[j].numpy())
                for k, v in batch.items()
                if k not in ("row", "padded")
            }
    return found


def _check(found: dict[int, dict[str, Any]], written: dict[int, dict[str, Any]], split: str):
    mine = {i: w for i, w in written.items() if w["split"] == split}
    assert sorted(found) == sorted(mine)
    for i, sample in found.items():
        image = sample.pop("image").transpose(1, 2, 0)  # CHW uint8 from the loader
        np.testing.assert_array_equal(image, _pixels(i), err_msg=f"row {i}")
        expected = {k: v for k, v in mine[i].items() if k != "split"}
        assert {k: (int(v) if k == "label" else v) for k, v in sample.items()} == expected


def test_pyarrow_columns_round_trip(tmp_path: Path) -> None:
    written = _plain_dataset(tmp_path / "ds")
    out = tmp_path / "out"
    args = ["shard", "parquet", str(tmp_path / "ds"), str(out), "--max-count", "4"]
    assert main([*args, "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["classes"] == ["cat", "dog", "emu"]  # string labels: sorted names
    assert load_manifest(out).split("train").num_samples == 11
    kinds = {n: f["kind"] for n, f in manifest["splits"]["train"]["fields"].items()}
    assert kinds == {
        "image": "image",
        "label": "label",
        "caption": "text",
        "row": "json",
        "score": "json",
        "tags": "json",
    }
    _check(_loaded(out, "train"), written, "train")
    _check(_loaded(out, "val"), written, "val")


def test_hugging_face_layout_round_trip(tmp_path: Path) -> None:
    written = _hf_dataset(tmp_path / "hub")
    source = ParquetSource(tmp_path / "hub")
    assert source.splits() == {"test": 4, "train": 12}
    assert source.classes == ZOO  # from the `huggingface` schema metadata, in its order
    assert (source.image_column, source.label_column) == ("image", "label")
    out = tmp_path / "out"
    write_shards(source, out, ShardOptions(max_count=5, workers=2, progress=False))
    assert json.loads((out / "manifest.json").read_text())["classes"] == ZOO
    _check(_loaded(out, "train"), written, "train")
    _check(_loaded(out, "test"), written, "test")


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and WORK_DIR not in p.parts
    }


def test_same_bytes_twice_and_parts_plus_merge_equal_one_run(tmp_path: Path) -> None:
    _hf_dataset(tmp_path / "hub")
    common = ["--max-count", "3", "--seed", "7", "--no-progress", "--workers", "2"]
    one, two, parts = tmp_path / "one", tmp_path / "two", tmp_path / "parts"
    assert main(["shard", "parquet", str(tmp_path / "hub"), str(one), *common]) == 0
    assert main(["shard", "parquet", str(tmp_path / "hub"), str(two), *common]) == 0
    single = _tree(one)
    assert len([n for n in single if n.endswith(".tar")]) == 6  # 12 train + 4 test, 3 a shard
    assert _tree(two) == single
    for index in (2, 0, 1):
        args = ["shard", "parquet", str(tmp_path / "hub"), str(parts), *common]
        assert main([*args, "--part", f"{index}/3"]) == 0
    assert main(["merge", str(parts)]) == 0
    assert _tree(parts) == single
    # The same input again: recognised as this dataset (the fingerprint is stable), not rewritten.
    assert main(["shard", "parquet", str(tmp_path / "hub"), str(one), *common]) == 0
    assert _tree(one) == single


def test_label_out_of_range_names_file_row_group_and_row(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    rows = {"image": [{"bytes": _png(_pixels(i)), "path": None} for i in range(5)]}
    rows["label"] = [0, 1, 2, 0, 3]  # 3 is not one of the 3 names below
    file = tmp_path / "train-00000-of-00001.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(file), batch_size=2)
    with pytest.raises(BadSourceError, match="not one of the 3 classes") as info:
        ParquetSource(file, classes=ZOO)
    assert f"{file}: row group 2, row 0 (row 4 of the file): label 3" in str(info.value)
    assert ParquetSource(file).classes == ["0", "1", "2", "3"]  # no names: indices 0..max


def test_missing_and_unusable_columns_name_the_file(tmp_path: Path) -> None:
    file = tmp_path / "plain.parquet"
    table = {"jpeg": [b"x"], "label": [1], "when": pa.array([0], pa.timestamp("s"))}
    pq.write_table(pa.table(table), file)
    with pytest.raises(BadSourceError, match=r"no column 'photo' for the images") as info:
        ParquetSource(file, image="photo")
    assert str(file) in str(info.value)
    with pytest.raises(BadSourceError, match=r"column 'when' is timestamp.*columns=\[") as info:
        ParquetSource(file)
    assert str(file) in str(info.value)
    assert ParquetSource(file, columns=[]).sample_fields("train") is None
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(BadSourceError, match="broken.parquet: not a readable Parquet file"):
        ParquetSource(tmp_path)


def test_undecodable_image_is_skipped_and_named_by_row(tmp_path: Path) -> None:
    file = tmp_path / "ds.parquet"
    images = [_png(_pixels(i)) for i in range(6)]
    images[4] = b"\x89PNG but cut short"
    pq.write_table(pa.table({"image": images, "label": [0, 1] * 3}), file, row_group_size=4)
    source = open_source("parquet", file)
    lenient = ShardOptions(workers=1, progress=False, max_bad=0.5)
    manifest = write_shards(source, tmp_path / "out", lenient)
    assert manifest.split("train").num_samples == 5
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert f"{file}: row group 1, row 0 (row 4 of the file)" in json.dumps(saved)
    strict = ShardOptions(workers=1, progress=False, strict=True)
    with pytest.raises(ShardingError, match=r"row group 1, row 0 \(row 4 of the file\)"):
        write_shards(source, tmp_path / "strict", strict)


def test_path_column_relative_to_the_parquet_file(tmp_path: Path) -> None:
    for i in range(3):
        Image.fromarray(_pixels(i)).save(tmp_path / f"{i}.png")
    file = tmp_path / "list.parquet"
    pq.write_table(
        pa.table({"image_path": [f"{i}.png" for i in range(3)], "label": [2, 0, 1]}), file
    )
    source = ParquetSource(file, split="val")
    assert source.splits() == {"val": 3} and source.sample_fields("val") is None
    item = source.item("val", 1)
    assert (item.path, item.label, item.data) == (tmp_path / "1.png", 0, None)


def test_same_shards_as_the_image_folder_the_rows_came_from(tmp_path: Path) -> None:
    """A folder's files as Hub-style rows (same order, same bytes, names in the metadata) shard
    byte-identically to the folder: JPEGs kept as they are, PNGs stored as PNG, same plan."""
    folder = FolderSource(write_jpeg_folder(tmp_path / "images", classes=3, per_class=4))
    items = [folder.item("train", i) for i in range(folder.splits()["train"])]
    table = pa.table(
        {
            "image": [{"bytes": it.path.read_bytes(), "path": it.path.name} for it in items],
            "label": [it.label for it in items],
        }
    )
    names = {"label": {"names": folder.classes, "_type": "ClassLabel"}, "image": {"_type": "Image"}}
    table = table.replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": names}})}
    )
    (tmp_path / "hub").mkdir()
    pq.write_table(table, tmp_path / "hub" / "train-00000-of-00001.parquet", row_group_size=5)
    options = ShardOptions(max_count=5, workers=1, progress=False)
    write_shards(folder, tmp_path / "from_folder", options)
    write_shards(ParquetSource(tmp_path / "hub"), tmp_path / "from_parquet", options)
    # The shards alike; the manifest and the source ids (paths / file:row) name each source.
    shards = {n: d for n, d in _tree(tmp_path / "from_folder").items() if n.endswith(_SHARD)}
    assert len([n for n in shards if n.endswith(".tar")]) == 3
    parquet = _tree(tmp_path / "from_parquet")
    assert {n: parquet.get(n) for n in shards} == shards
    ids = json.loads(parquet["train-source-ids.json"])["ids"]
    assert sorted(ids.values()) == sorted(f"train-00000-of-00001.parquet:{i}" for i in range(12))
    assert ids["train_00000007"] == "train-00000-of-00001.parquet:7"


_SHARD = (".tar", ".idx", ".sum")


def test_a_cache_smaller_than_a_row_group_gives_the_same_items(tmp_path: Path) -> None:
    file = tmp_path / "ds.parquet"
    images = [_png(_pixels(i)) for i in range(7)]
    pq.write_table(pa.table({"image": images, "label": list(range(7))}), file, row_group_size=2)
    small = ParquetSource(file, cache_bytes=1)  # keeps only the row group read last
    order = [6, 0, 3, 6, 1, 5, 2, 4, 0]
    assert [small.item("train", i).data for i in order] == [images[i] for i in order]
    assert len(small._cache) == 1
    roomy = ParquetSource(file)
    assert [roomy.item("train", i).data for i in order] == [images[i] for i in order]
    assert len(roomy._cache) == 4  # every row group, read once
