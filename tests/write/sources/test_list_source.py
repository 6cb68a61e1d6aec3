"""ListSource on CSV and JSON Lines files, and open_source's registry."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from fastdata.write.sources import SOURCES, BadSourceError, ListSource, Source, open_source


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _jsonl(path: Path, records: list[object]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


def test_csv_with_names_and_splits(tmp_path: Path) -> None:
    lst = _write(
        tmp_path / "lists" / "labels.csv",
        "path,label,split\nimg/1.jpg,dog,\nimg/2.jpg,cat,val\n/abs/3.png,dog,val\nimg/4.jpg,cat,\n",
    )
    src = open_source("list", lst)
    assert isinstance(src, Source) and src.kind == "list"
    assert src.classes == ["cat", "dog"]
    assert src.splits() == {"train": 2, "val": 2}
    first = src.item("train", 0)
    assert first.path == tmp_path / "lists" / "img" / "1.jpg"  # relative to the list's folder
    assert first.label == 1 and first.pixels is None
    assert first.origin == f"{first.path} (labels.csv:2)"
    assert src.item("val", 1).path == Path("/abs/3.png")
    assert [src.item("train", i).label for i in range(2)] == [1, 0]


def test_jsonl_with_indices_and_root(tmp_path: Path) -> None:
    lst = _jsonl(
        tmp_path / "l.jsonl",
        [{"path": "a.png", "label": 2}, {"path": "b.png", "label": 0, "split": "test"}],
    )
    src = ListSource(lst, root=tmp_path / "images", split="trainval")
    assert src.classes == ["0", "1", "2"]
    assert src.splits() == {"trainval": 1, "test": 1}
    assert src.item("trainval", 0).path == tmp_path / "images" / "a.png"
    assert src.item("trainval", 0).label == 2


def test_given_classes_accept_names_and_indices(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", "path,label\na.png,zebra\nb.png,0\nc.png,2\n")
    src = ListSource(lst, classes=["ant", "bee", "zebra"])
    assert [src.item("train", i).label for i in range(3)] == [2, 0, 2]
    # A class whose name is a number is found by name first.
    named = ListSource(_write(tmp_path / "n.csv", "path,label\na.png,3\n"), classes=["7", "3"])
    assert named.item("train", 0).label == 1


@pytest.mark.parametrize(
    ("name", "text", "line", "problem"),
    [
        ("h.csv", "file,label\na.png,1\n", 1, "lacks 'path'"),
        ("c.csv", "path,label\na.png,1\nb.png\n", 3, "columns expected"),
        ("e.csv", "path,label\na.png,1\n,2\n", 3, "empty path or label"),
        ("m.csv", "path,label\na.png,1\nb.png,dog\n", 3, "differs in kind from the class indices"),
        ("n.csv", "path,label\na.png,-1\n", 2, "negative label"),
        (
            "j.jsonl",
            '{"path": "a.png", "label": 1}\n\n{"path": "b.png", "label": 1\n',
            3,
            "not valid JSON",
        ),
        ("b.jsonl", '{"path": "a.png", "label": true}\n', 1, "'label' must be an int"),
        ("p.jsonl", '{"path": "", "label": 1}\n', 1, "'path' must be a non-empty string"),
        ("o.jsonl", '["a.png", 1]\n', 1, "expected an object"),
        ("s.jsonl", '{"path": "a.png", "label": 1, "split": 3}\n', 1, "'split' must be a string"),
    ],
)
def test_bad_lines_name_the_file_and_line(
    tmp_path: Path, name: str, text: str, line: int, problem: str
) -> None:
    lst = _write(tmp_path / name, text)
    with pytest.raises(BadSourceError, match=problem) as info:
        ListSource(lst)
    assert f"{lst}:{line}:" in str(info.value)


def test_label_outside_given_classes(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", "path,label\na.png,ant\nb.png,5\n")
    with pytest.raises(BadSourceError, match=f"{tmp_path / 'l.csv'}:3: label '5' is neither"):
        ListSource(lst, classes=["ant", "bee"])


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("l.txt", "a.png 1\n", "unknown list format '.txt'"),
        ("l.csv", "path,label\n", "lists no images"),
    ],
)
def test_unusable_list_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(BadSourceError, match=message):
        ListSource(_write(tmp_path / name, text))
    with pytest.raises(BadSourceError, match="no such list file"):
        ListSource(tmp_path / "absent.csv")


def test_fingerprint_follows_the_list(tmp_path: Path) -> None:
    lst = _write(tmp_path / "l.csv", "path,label\na.png,cat\n")
    first = ListSource(lst).fingerprint()
    assert first["path"] == str(lst.resolve()) and first["classes"] == ["cat"]
    assert ListSource(lst).fingerprint() == first
    _write(lst, "path,label\na.png,cat\nb.png,dog\n")
    assert ListSource(lst).fingerprint() != first


def test_source_survives_pickling(tmp_path: Path) -> None:
    src = ListSource(_write(tmp_path / "l.csv", "path,label,split\na.png,x,\nb.png,y,val\n"))
    copy = pickle.loads(pickle.dumps(src))
    assert copy.splits() == src.splits() and copy.item("val", 0) == src.item("val", 0)


def test_open_source_registry(tmp_path: Path) -> None:
    assert set(SOURCES) == {
        "cifar10",
        "cifar100",
        "folder",
        "list",
        "coco",
        "segmentation",
        "parquet",
        "video",
    }
    with pytest.raises(ValueError, match="'imagenet'.*cifar10, cifar100, folder, list"):
        open_source("imagenet", tmp_path)
    with pytest.raises(ValueError, match="needs the dataset folder"):
        open_source("folder", None)


def test_non_ascii_paths_and_labels(tmp_path: Path) -> None:
    lst = _write(
        tmp_path / "liste.csv", "path,label\nbilder/café_日本.JPG,chat\nbilder/ü.png,hund\n"
    )
    src = open_source("list", lst)
    assert src.classes == ["chat", "hund"]
    assert src.item("train", 0).path == tmp_path / "bilder" / "café_日本.JPG"
