"""FolderSource on tiny class-per-folder trees of real PNG files, and on clothing-small."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.write.sources import BadSourceError, FolderSource, Source, open_source


def _png(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((2, 3, 3), value, np.uint8)).save(path)
    return path


def _tree(root: Path, files: list[str]) -> Path:
    """Create `files` under `root`: images get real PNG bytes, others a line of text."""
    for i, rel in enumerate(files):
        path = root / rel
        if Path(rel).suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"}:
            _png(path, i)  # PIL picks the format from the suffix; the bytes do not matter here
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("not an image\n")
    return root


def test_flat_layout(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "ds",
        [
            "dog/b.png",
            "dog/a.PNG",
            "dog/nested/c.png",
            "cat/z.jpg",
            "cat/notes.txt",
            "cat/.hidden.png",
            ".cache/x.png",
            "readme.md",
        ],
    )
    src = open_source("folder", root)
    assert isinstance(src, Source) and src.kind == "folder"
    assert src.classes == ["cat", "dog"]
    assert src.splits() == {"train": 4}
    items = [src.item("train", i) for i in range(4)]
    assert [it.path.relative_to(root).as_posix() for it in items] == [
        "cat/z.jpg",
        "dog/a.PNG",
        "dog/b.png",
        "dog/nested/c.png",
    ]
    assert [it.label for it in items] == [0, 1, 1, 1]
    assert all(it.pixels is None and it.origin == str(it.path) for it in items)
    assert src.ignored_files == 2  # notes.txt, readme.md; hidden files are skipped silently


def test_split_layout_keeps_names_and_labels(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "ds",
        [
            "train/b/1.png",
            "train/c/1.png",
            "validation/a/1.png",
            "validation/c/2.png",
            "test/b/9.png",
            "LICENSE",
        ],
    )
    src = FolderSource(root)
    assert src.splits() == {"test": 1, "train": 2, "validation": 2}
    assert src.classes == ["a", "b", "c"]  # union across splits: indices agree everywhere
    assert [src.item("validation", i).label for i in range(2)] == [0, 2]
    assert [src.item("train", i).label for i in range(2)] == [1, 2]
    assert src.item("test", 0).label == 1


def test_train_class_with_images_is_not_a_split(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", ["train/1.png", "bus/1.png"])
    src = FolderSource(root)
    assert src.splits() == {"train": 2} and src.classes == ["bus", "train"]


def test_explicit_splits(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", ["train/a/1.png", "extra/a/1.png", "extra/b/2.png"])
    with pytest.raises(BadSourceError, match="mixes split folders"):
        FolderSource(root)
    src = FolderSource(root, splits=["extra"])
    assert src.splits() == {"extra": 2} and src.classes == ["a", "b"]
    flat = FolderSource(root, splits="none")
    assert flat.classes == ["extra", "train"] and flat.splits() == {"train": 3}
    with pytest.raises(BadSourceError, match="'val'"):
        FolderSource(root, splits=["val"])
    with pytest.raises(ValueError, match="'everything'"):
        FolderSource(root, splits="everything")


@pytest.mark.parametrize(
    ("files", "message"),
    [([], "no class folders"), (["a/notes.txt", "b/.x.png"], "no images")],
)
def test_empty_trees_are_bad_sources(tmp_path: Path, files: list[str], message: str) -> None:
    root = _tree(tmp_path / "ds", files)
    root.mkdir(exist_ok=True)
    with pytest.raises(BadSourceError, match=message) as info:
        FolderSource(root)
    assert str(root) in str(info.value) and "root/<class>/<image>" in str(info.value)


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(BadSourceError, match="not a folder"):
        FolderSource(tmp_path / "absent")


def test_fingerprint_follows_the_files(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", ["a/1.png", "b/2.png"])
    first = FolderSource(root).fingerprint()
    sizes = sum(p.stat().st_size for p in root.rglob("*.png"))
    assert first["files"] == 2 and first["bytes"] == sizes and first["root"] == str(root.resolve())
    assert FolderSource(root).fingerprint() == first
    _png(root / "a" / "3.png")
    assert FolderSource(root).fingerprint()["files"] == 3


def test_source_survives_pickling(tmp_path: Path) -> None:
    src = FolderSource(_tree(tmp_path / "ds", ["a/1.png", "b/2.png"]))
    copy = pickle.loads(pickle.dumps(src))
    assert copy.splits() == src.splits() and copy.item("train", 1) == src.item("train", 1)


def test_item_bounds(tmp_path: Path) -> None:
    src = FolderSource(_tree(tmp_path / "ds", ["a/1.png"]))
    with pytest.raises(IndexError):
        src.item("train", 1)
    with pytest.raises(ValueError, match="'test'"):
        src.item("test", 0)


@pytest.mark.realdata
def test_real_clothing_small(real_data: Path) -> None:
    root = real_data / "clothing-small"
    if not root.is_dir():
        pytest.skip(f"{root} is absent")
    src = open_source("folder", root)
    assert src.splits() == {"test": 372, "train": 800, "validation": 341}
    assert src.classes == [
        "dress",
        "hat",
        "longsleeve",
        "outwear",
        "pants",
        "shirt",
        "shoes",
        "shorts",
        "skirt",
        "t-shirt",
    ]
    for split, count in src.splits().items():
        for i in (0, count // 2, count - 1):
            item = src.item(split, i)
            assert item.path.suffix == ".jpg" and item.path.is_file()
            assert item.path.parent.name == src.classes[item.label]
            assert item.path.parent.parent.name == split
    train_labels = [src.item("train", i).label for i in range(800)]
    assert np.bincount(train_labels).tolist() == [80] * 10
    assert src.fingerprint()["files"] == 1513


def test_extensions_in_any_case_and_non_ascii_names(tmp_path: Path) -> None:
    names = ["IMG_0001.JPG", "b.Jpeg", "c.TIF", "d.tiff", "e.WebP", "f.GIF", "g.bmp", "h.jp2"]
    names += ["café_日本.png", "Ünïcödé.JPEG"]
    for name in names:
        (tmp_path / "ds" / "klasse_é").mkdir(parents=True, exist_ok=True)
        (tmp_path / "ds" / "klasse_é" / name).write_bytes(b"bytes are checked by the writer")
    (tmp_path / "ds" / "klasse_é" / "notes.TXT").write_text("not an image")
    src = FolderSource(tmp_path / "ds")
    assert src.classes == ["klasse_é"]
    assert sorted(src.item("train", i).path.name for i in range(len(names))) == sorted(names)
    assert src.splits() == {"train": len(names)} and src.ignored_files == 1
