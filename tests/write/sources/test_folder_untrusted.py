"""An image folder is untrusted: unreadable folders and odd symlinks are listed, never lost."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, FolderSource

OPTS = ShardOptions(max_count=4, workers=1, progress=False, max_bad=0.5)


def _png(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((2, 3, 3), value, np.uint8)).save(path)
    return path


def _tree(root: Path, per_class: dict[str, int]) -> Path:
    for name, count in per_class.items():
        for i in range(count):
            _png(root / name / f"{i}.png", i)
    return root


def _unreadable(monkeypatch: pytest.MonkeyPatch, *folders: Path) -> None:
    """os.scandir of `folders` fails as for a folder without read permission (works as root)."""
    real = os.scandir
    denied = {str(f) for f in folders}

    def scandir(path: str | int | os.PathLike[str] = ".") -> object:
        if not isinstance(path, int) and os.fspath(path) in denied:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def _skipped(manifest: object) -> dict[str, str]:
    return {s.origin: s.reason for split in manifest.splits.values() for s in split.skipped}


def test_an_unreadable_class_folder_is_listed_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "ds", {"cat": 3, "dog": 3, "eel": 3})
    _unreadable(monkeypatch, root / "dog")
    src = FolderSource(root)
    assert src.classes == ["cat", "dog", "eel"]  # the class stays: labels do not shift
    assert src.splits() == {"train": 6}
    assert src.skipped == {"train": [(str(root / "dog"), "cannot list folder (Permission denied)")]}
    manifest = write_shards(src, tmp_path / "out", OPTS)
    assert _skipped(manifest) == {str(root / "dog"): "cannot list folder (Permission denied)"}
    assert manifest.splits["train"].num_samples == 6


def test_an_unreadable_sub_folder_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "ds", {"cat": 2, "cat/deep": 2})
    _unreadable(monkeypatch, root / "cat" / "deep")
    src = FolderSource(root)
    assert src.splits() == {"train": 2}
    assert [o for o, _ in src.skipped["train"]] == [str(root / "cat" / "deep")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod-000 folder")
def test_a_chmod_000_class_folder_is_listed(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", {"cat": 2, "dog": 2})
    (root / "dog").chmod(0)
    try:
        src = FolderSource(root)
        assert src.splits() == {"train": 2}
        assert src.skipped["train"][0][0] == str(root / "dog")
    finally:
        (root / "dog").chmod(0o755)


def test_an_unreadable_dataset_folder_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "ds", {"cat": 1})
    _unreadable(monkeypatch, root)
    with pytest.raises(BadSourceError, match="cannot list the folder") as info:
        FolderSource(root)
    assert str(root) in str(info.value)


@pytest.mark.parametrize("target", ["root", "ancestor", "sibling", "self"])
def test_a_class_folder_linking_back_into_the_tree_is_not_duplicated(
    tmp_path: Path, target: str
) -> None:
    root = _tree(tmp_path / "ds", {"cat": 2, "dog": 2})
    link = root / "zzz"
    pointed = {
        "root": root,
        "ancestor": tmp_path,
        "sibling": root / "cat",
        "self": link,
    }[target]
    link.symlink_to(pointed, target_is_directory=True)
    src = FolderSource(root)
    assert src.classes == ["cat", "dog"] and src.splits() == {"train": 4}
    ((origin, reason),) = src.skipped["train"]
    assert origin == str(link)
    assert ("symlink" in reason) and ("counted twice" in reason or "broken" in reason)


def test_a_class_folder_linking_outside_the_dataset_is_used(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", {"cat": 2})
    elsewhere = _tree(tmp_path / "other", {"dog": 3})
    (root / "dog").symlink_to(elsewhere / "dog", target_is_directory=True)
    src = FolderSource(root)
    assert src.classes == ["cat", "dog"] and src.splits() == {"train": 5}
    assert src.skipped == {}


def test_dangling_and_looping_symlinks_are_listed_and_do_not_abort(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ds", {"cat": 10, "dog": 10})
    dangling = root / "cat" / "gone.png"
    dangling.symlink_to(root / "cat" / "never-there.png")
    loop = root / "dog" / "loop.png"
    loop.symlink_to(loop)
    folder_link = root / "dog" / "more"
    folder_link.symlink_to(root / "cat", target_is_directory=True)
    class_loop = root / "eel"
    class_loop.symlink_to(class_loop, target_is_directory=True)
    src = FolderSource(root)
    assert src.splits() == {"train": 20}
    found = dict(src.skipped["train"])
    assert set(found) == {str(dangling), str(loop), str(folder_link), str(class_loop)}
    assert "No such file" in found[str(dangling)] and "broken symlink" in found[str(dangling)]
    assert "Too many levels of symbolic links" in found[str(loop)]
    assert "not followed" in found[str(folder_link)]
    manifest = write_shards(src, tmp_path / "out", OPTS)  # fingerprint no longer stats them
    assert manifest.splits["train"].num_samples == 20
    assert set(_skipped(manifest)) == set(found)


def test_the_source_losses_count_towards_max_bad(tmp_path: Path) -> None:
    from fastdata.write import TooManyBadSamplesError

    root = _tree(tmp_path / "ds", {"cat": 4})
    for i in range(3):
        (root / "cat" / f"gone{i}.png").symlink_to(root / f"absent{i}")
    with pytest.raises(TooManyBadSamplesError, match="3 of 7 inputs are bad") as info:
        write_shards(FolderSource(root), tmp_path / "out", ShardOptions(workers=1, progress=False))
    assert "gone0.png" in str(info.value)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.tar"))  # stopped before writing a shard


def test_an_unreadable_image_file_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "ds", {"cat": 3})
    locked = root / "cat" / "1.png"
    real_open = os.open

    def os_open(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", os_open)  # as chmod 000 does for a user other than root
    manifest = write_shards(FolderSource(root), tmp_path / "out", OPTS)
    assert _skipped(manifest) == {str(locked): "cannot read file (Permission denied)"}
    assert manifest.splits["train"].num_samples == 2
