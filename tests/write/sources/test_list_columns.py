"""List files with more columns than path and label: multi-label, captions, JSON values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, ListSource
from tests.write.sources.family_data import read_samples, rect_pixels, save_image

OPTS = ShardOptions(max_count=2, workers=1, progress=False)


def _images(root: Path, count: int) -> None:
    for i in range(count):
        save_image(root / f"{i}.png", rect_pixels(16, 12, (i, 0, i + 3, 5)))


def _decoded(manifest, split: str) -> dict[str, dict]:
    info = manifest.split(split)
    found: dict[str, dict] = {}
    for shard in info.shards:
        found.update(read_samples(Path(manifest.shard_url(shard)), info.field_specs))
    return found


def test_csv_labels_caption_and_other_columns(tmp_path: Path) -> None:
    _images(tmp_path, 3)
    lst = tmp_path / "l.csv"
    lst.write_text(
        'path,labels,caption,source\n0.png,cat;dog,"a cat, a dog",web\n'
        "1.png,dog,one dog,book\n2.png,,nothing here,web\n"
    )
    source = ListSource(lst)
    assert source.classes == ["cat", "dog"]
    fields = source.sample_fields("train")
    assert {n: (f.kind, f.components) for n, f in fields.items()} == {
        "labels": ("labels", ("labels.npy",)),
        "caption": ("text", ("caption.txt",)),
        "source": ("text", ("source.txt",)),
    }
    manifest = write_shards(source, tmp_path / "out", OPTS)
    found = _decoded(manifest, "train")
    got = {k: (v["labels"].tolist(), v["caption"], v["source"]) for k, v in found.items()}
    assert got == {
        "train_00000000": ([0, 1], "a cat, a dog", "web"),
        "train_00000001": ([1], "one dog", "book"),
        "train_00000002": ([], "nothing here", "web"),
    }
    assert manifest.split("train").class_counts == [1, 2]


def test_jsonl_labels_list_caption_and_json_values(tmp_path: Path) -> None:
    _images(tmp_path, 3)
    rows = [
        {"path": "0.png", "label": 1, "labels": [0, 2], "caption": "zero", "meta": {"k": [1, 2]}},
        {"path": "1.png", "label": 0, "labels": "2", "caption": "one", "split": "val"},
        {"path": "2.png", "label": 2, "caption": "two", "meta": 7},
    ]
    lst = tmp_path / "l.jsonl"
    lst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = ListSource(lst)
    kinds = {n: (f.kind, f.components) for n, f in source.sample_fields("train").items()}
    assert kinds == {
        "label": ("label", ("cls", "lid")),
        "labels": ("labels", ("labels.npy",)),
        "caption": ("text", ("txt",)),  # the only text field: webdataset's name
        "meta": ("json", ("json",)),
    }
    manifest = write_shards(source, tmp_path / "out", OPTS)
    train, val = _decoded(manifest, "train"), _decoded(manifest, "val")
    assert {
        k: (v["label"], v["labels"].tolist(), v["caption"], v["meta"]) for k, v in train.items()
    } == {
        "train_00000000": (1, [0, 2], "zero", {"k": [1, 2]}),
        "train_00000001": (2, [], "two", 7),
    }
    (only,) = val.values()
    assert (only["label"], only["labels"].tolist(), only["meta"]) == (0, [2], None)
    np.testing.assert_array_equal(only["image"][0, 1], [230, 40, 30])


def test_path_and_label_alone_stay_classification(tmp_path: Path) -> None:
    _images(tmp_path, 2)
    lst = tmp_path / "l.csv"
    lst.write_text("path,label\n0.png,a\n1.png,b\n")
    assert ListSource(lst).sample_fields("train") is None
    manifest = write_shards(ListSource(lst), tmp_path / "out", OPTS)
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "fields" not in saved["splits"]["train"] and manifest.split("train").fields is None


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("a.jsonl", '{"path": "0.png", "label": 1}\n{"path": "1.png"}\n', "'label' is missing"),
        ("b.jsonl", '{"path": "0.png", "labels": {"a": 1}}\n', "'labels' must be a list"),
        ("c.jsonl", '{"path": "0.png", "caption": 3}\n', "'caption' must be a string"),
        ("d.csv", "path,my col\n0.png,x\n", "column 'my col' cannot be a field"),
        ("e.csv", "path,labels\n0.png,cat\n1.png,7\n", "differs in kind"),
    ],
)
def test_bad_columns_name_the_line(tmp_path: Path, name: str, text: str, problem: str) -> None:
    lst = tmp_path / name
    lst.write_text(text)
    with pytest.raises(BadSourceError, match=problem) as info:
        ListSource(lst)
    assert str(lst) in str(info.value)
