"""Sharding on many machines: parts in any order + merge == one run; merge names what is missing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastdata.cli import main
from fastdata.format.manifest import MANIFEST_NAME
from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.parts import MergeError, Part, merge_parts, write_part
from fastdata.write.sources.folder import FolderSource
from fastdata.write.writer import WORK_DIR
from tests.conftest import unique_label_source, write_jpeg_folder

OPTS = ShardOptions(max_count=16, workers=1, progress=False)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative name -> bytes), work folder excluded."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and WORK_DIR not in p.parts
    }


def _shard_list(out: Path) -> dict[str, list]:
    manifest = load_manifest(out)
    return {name: split.shards for name, split in manifest.splits.items()}


def test_parts_in_order_2_0_1_then_merge_equal_one_run(tmp_path):
    source = unique_label_source(n_train=100, n_test=30)  # 7 + 2 shards: 3 per part
    write_shards(source, tmp_path / "single", OPTS)
    out = tmp_path / "parts"
    for index in (2, 0, 1):
        report = write_part(source, out, OPTS, Part(index, 3))
        assert len(report.shards) == 3 and report.already_done == 0
        assert not (out / MANIFEST_NAME).exists()  # parts never write the manifest
    merge_parts(out)
    single, merged = _tree(tmp_path / "single"), _tree(out)
    assert sorted(merged) == sorted(single)
    assert [n for n in merged if n.endswith(".tar")] and [n for n in merged if n.endswith(".idx")]
    for name, data in single.items():
        assert merged[name] == data, f"{name} differs from the single run's"
    assert _shard_list(out) == _shard_list(tmp_path / "single")
    assert not (out / WORK_DIR).exists()
    # A part run again after the merge does nothing.
    assert write_part(source, out, OPTS, Part(1, 3)).merged


def test_cli_parts_and_merge_on_a_folder(tmp_path, capsys):
    images = write_jpeg_folder(tmp_path / "images", classes=3, per_class=5)
    common = ["folder", str(images), "--max-count", "2", "--no-progress", "--workers", "1"]
    assert main(["shard", *common[:2], str(tmp_path / "single"), *common[2:]]) == 0
    out = tmp_path / "parts"
    for index in (1, 3, 0, 2):
        args = ["shard", *common[:2], str(out), *common[2:], "--part", f"{index}/4"]
        assert main(args) == 0
    assert f"fastdata merge {out}" in capsys.readouterr().out
    assert main(["merge", str(out)]) == 0
    assert _tree(out) == _tree(tmp_path / "single")


def test_merge_names_a_missing_part_its_shards_and_the_command(tmp_path, capsys):
    images = write_jpeg_folder(tmp_path / "images", classes=3, per_class=5)
    out = tmp_path / "out"
    base = ["shard", "folder", str(images), str(out), "--max-count", "2", "--no-progress"]
    for index in (0, 2):
        assert main([*base, "--part", f"{index}/3"]) == 0
    capsys.readouterr()
    assert main(["merge", str(out)]) == 2
    error = capsys.readouterr().err
    assert "part 1/3 has not run" in error
    assert "train-000001" in error and "train-000004" in error  # jobs 1, 4, 7 are part 1's
    assert "train-000000" not in error
    assert "--max-count 2 --part 1/3" in error
    assert not (out / MANIFEST_NAME).exists()
    assert main([*base, "--part", "1/3"]) == 0
    assert main(["merge", str(out)]) == 0
    assert load_manifest(out).split("train").num_samples == 15


def test_merge_names_an_unfinished_part(tmp_path):
    source = unique_label_source(n_train=100, n_test=30)
    out = tmp_path / "out"
    for index in range(3):
        write_part(source, out, OPTS, Part(index, 3), command="fastdata shard ... --part {part}")
    # As if part 1 had been killed after its first shard: record "started", two shards not done.
    record_path = out / WORK_DIR / Part(1, 3).record_name
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "status": "started"}))
    # Part 1 has jobs 1, 4, 7: test-000001, train-000002, train-000005 ("test" sorts first).
    (out / WORK_DIR / "train-000002.done.json").unlink()
    (out / "train-000005.tar").unlink()  # a done record whose tar is gone does not count
    with pytest.raises(MergeError) as info:
        merge_parts(out)
    message = str(info.value)
    assert "part 1/3 did not finish" in message and "1 of 3 shards written" in message
    assert "train-000002, train-000005 are missing" in message
    assert "run `fastdata shard ... --part 1/3`" in message
    # Running the part again resumes it; then the merge succeeds.
    assert write_part(source, out, OPTS, Part(1, 3)).already_done == 1
    assert merge_parts(out).split("train").num_samples == 100


def test_parts_with_different_options_are_refused(tmp_path):
    source = unique_label_source(n_train=100, n_test=30)
    other = ShardOptions(max_count=16, seed=1, workers=1, progress=False)
    write_part(source, tmp_path / "out", OPTS, Part(0, 3))
    with pytest.raises(ShardingError, match=r"options\.seed: 0 \(in the folder\) vs 1"):
        write_part(source, tmp_path / "out", other, Part(1, 3))
    # Parts written in separate folders and copied together: merge finds the difference.
    write_part(source, tmp_path / "b", other, Part(1, 3))
    write_part(source, tmp_path / "b", other, Part(2, 3))
    for path in (tmp_path / "b").rglob("*"):
        target = tmp_path / "out" / path.relative_to(tmp_path / "b")
        if path.is_file() and path.name != "plan.json":
            shutil.copy(path, target)
    with pytest.raises(MergeError, match=r"part 1/3 was run with another source or options"):
        merge_parts(tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_merge_with_different_part_counts_is_refused(tmp_path):
    source = unique_label_source(n_train=100, n_test=30)
    write_part(source, tmp_path / "out", OPTS, Part(0, 2))
    write_part(source, tmp_path / "out", OPTS, Part(1, 3))
    with pytest.raises(MergeError, match="different N"):
        merge_parts(tmp_path / "out")


def test_nothing_to_merge_and_bad_part_values(tmp_path):
    with pytest.raises(MergeError, match="no part has run"):
        merge_parts(tmp_path)
    for text in ("3/3", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(ValueError, match="I/N"):
            Part.parse(text)
    assert Part.parse("2/8") == Part(2, 8)
    source = unique_label_source(n_train=20, n_test=5)
    overwrite = ShardOptions(overwrite=True, workers=1, progress=False)
    with pytest.raises(ShardingError, match="--overwrite cannot be used with --part"):
        write_part(source, tmp_path / "x", overwrite, Part(0, 2))


def test_part_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ShardingError, match="not empty"):
        write_part(unique_label_source(n_train=20, n_test=5), tmp_path, OPTS, Part(0, 2))


def test_more_parts_than_shards(tmp_path):
    images = write_jpeg_folder(tmp_path / "images", classes=2, per_class=2)
    source = FolderSource(images)
    for index in range(5):  # 1 job, 5 parts: four of them have nothing to write
        write_part(source, tmp_path / "out", OPTS, Part(index, 5))
    assert merge_parts(tmp_path / "out").split("train").num_samples == 4


def test_merge_of_an_unfinished_single_run_says_to_rerun_it(tmp_path):
    images = write_jpeg_folder(tmp_path / "images", classes=2, per_class=2)
    (images / "class0" / "broken.jpg").write_bytes(b"")
    strict = ShardOptions(strict=True, workers=1, progress=False)
    with pytest.raises(ShardingError, match="empty file"):
        write_shards(FolderSource(images), tmp_path / "out", strict)
    with pytest.raises(MergeError, match="not run in parts; run the same `fastdata shard`"):
        merge_parts(tmp_path / "out")


def _folder_with_broken_links(root: Path, links: int) -> Path:
    from PIL import Image

    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(root / "train" / c / f"{i}.png")
    for i in range(links):
        os.symlink("/nonexistent", root / "train" / "a" / f"broken{i}.png")
    return root


def test_parts_count_the_sources_losses_once_in_merge(tmp_path: Path) -> None:
    """Every part sees the source's losses (a broken link): counted per part, a part with few
    or no shards went over max_bad where one run of the same input passes."""
    from fastdata.write.parts import Part, merge_parts, write_part
    from fastdata.write.sources.folder import FolderSource

    src = _folder_with_broken_links(tmp_path / "in", links=1)
    options = ShardOptions(max_count=10, workers=1, progress=False, max_bad=0.1)
    single = write_shards(FolderSource(src), tmp_path / "single", options)
    for i in range(6):  # parts 4 and 5 get no shard at all
        write_part(FolderSource(src), tmp_path / "parts", options, Part(i, 6))
    merged = merge_parts(tmp_path / "parts")
    assert merged.split("train").skipped == single.split("train").skipped
    assert len(merged.split("train").skipped) == 1


def test_merge_stops_when_the_whole_run_has_too_many_bad_inputs(tmp_path: Path) -> None:
    from fastdata.write import TooManyBadSamplesError
    from fastdata.write.parts import Part, merge_parts, write_part
    from fastdata.write.sources.folder import FolderSource

    src = _folder_with_broken_links(tmp_path / "in", links=6)  # 6 of 46 inputs: over 10%
    options = ShardOptions(max_count=10, workers=1, progress=False, max_bad=0.1)
    for i in range(2):
        write_part(FolderSource(src), tmp_path / "parts", options, Part(i, 2))
    with pytest.raises(TooManyBadSamplesError, match="6 of 46"):
        merge_parts(tmp_path / "parts")
    assert not (tmp_path / "parts" / "manifest.json").exists()
