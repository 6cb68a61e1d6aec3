"""The shard writer: round trip, determinism, resume, output-folder safety, bad input."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardingError, ShardOptions, write_shards
from fastdata.write.sources.folder import FolderSource
from tests.conftest import unique_label_source, write_jpeg_folder

OPTS = ShardOptions(max_count=64, workers=1, progress=False)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_with_tarfile_and_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")  # absent on the bare GPU machine
    source = unique_label_source(n_train=100, n_test=10)
    manifest = write_shards(source, tmp_path / "out", OPTS)
    train = manifest.split("train")
    assert train.num_samples == 100 and [s.num_samples for s in train.shards] == [64, 36]
    assert train.raw_shape == [8, 8, 3] and train.encoding == "raw"
    seen = {}
    for sample in wds.WebDataset([manifest.shard_url(s) for s in train.shards], shardshuffle=False):
        label, sample_id = np.frombuffer(sample["lid"], dtype="<i8")
        assert int(sample["cls"]) == label == sample_id
        assert sample["__key__"] == f"train_{sample_id:08d}"
        seen[int(sample_id)] = np.frombuffer(sample["rgb"], dtype=np.uint8).reshape(8, 8, 3)
    assert sorted(seen) == list(range(100))
    for i in (0, 57, 99):
        np.testing.assert_array_equal(seen[i], source.item("train", i).pixels)
    # pre-shuffled across shards: the first shard is not simply ids 0..63
    with tarfile.open(manifest.shard_url(train.shards[0])) as tar:
        first_ids = {int(m.name[6:14]) for m in tar.getmembers()}
    assert first_ids != set(range(64))


def test_index_matches_dalis_wds2idx(tmp_path):
    wds2idx = pytest.importorskip("wds2idx", reason="DALI's wds2idx tool is not installed")
    manifest = write_shards(unique_label_source(n_train=70), tmp_path / "out", OPTS)
    for shard in manifest.split("train").shards:
        ref = tmp_path / (shard.name + ".ref.idx")
        with wds2idx.IndexCreator(manifest.shard_url(shard), str(ref), verbose=False) as creator:
            creator.create_index()
        assert Path(manifest.index_url(shard)).read_text() == ref.read_text()


def test_same_input_and_seed_give_identical_bytes_whatever_the_workers(tmp_path):
    source = unique_label_source(n_train=200)
    write_shards(source, tmp_path / "a", ShardOptions(max_count=50, workers=1, progress=False))
    write_shards(source, tmp_path / "b", ShardOptions(max_count=50, workers=2, progress=False))
    write_shards(
        source, tmp_path / "c", ShardOptions(max_count=50, seed=1, workers=1, progress=False)
    )
    names = _files(tmp_path / "a")
    assert names == _files(tmp_path / "b")
    assert all(filecmp.cmp(tmp_path / "a" / n, tmp_path / "b" / n, shallow=False) for n in names)
    assert not filecmp.cmp(
        tmp_path / "a" / "train-000000.tar", tmp_path / "c" / "train-000000.tar", shallow=False
    )


def test_max_size_cuts_shards_by_estimated_bytes(tmp_path):
    manifest = write_shards(
        unique_label_source(n_train=100),
        tmp_path / "out",
        ShardOptions(max_count=1000, max_size=20 * 192, workers=1, progress=False),
    )
    assert [s.num_samples for s in manifest.split("train").shards] == [20] * 5


def test_rerun_is_a_no_op_and_a_different_dataset_is_refused(tmp_path):
    out = tmp_path / "out"
    first = write_shards(unique_label_source(), out, OPTS)
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert write_shards(unique_label_source(), out, OPTS).to_json() == first.to_json()
    assert (out / "manifest.json").stat().st_mtime_ns == mtime
    other = unique_label_source(n_train=120)
    with pytest.raises(ShardingError, match="different dataset.*--overwrite"):
        write_shards(other, out, OPTS)
    replaced = write_shards(
        other, out, ShardOptions(max_count=64, workers=1, progress=False, overwrite=True)
    )
    assert replaced.split("train").num_samples == 120
    assert _files(out) == sorted(
        [
            "manifest.json",
            "test-000000.idx",
            "test-000000.sum",
            "test-000000.tar",
            "train-000000.idx",
            "train-000000.sum",
            "train-000000.tar",
            "train-000001.idx",
            "train-000001.sum",
            "train-000001.tar",
        ]
    )


def test_non_empty_foreign_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ShardingError, match="not empty"):
        write_shards(unique_label_source(), out, OPTS)
    write_shards(
        unique_label_source(),
        out,
        ShardOptions(max_count=64, workers=1, progress=False, overwrite=True),
    )
    assert (out / "notes.txt").read_text() == "mine"  # --overwrite removes only shard files


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.conftest import unique_label_source
    from fastdata.write import ShardOptions, write_shards

    class Slow:
        def __init__(self, inner):
            self.inner, self.kind, self.classes = inner, inner.kind, inner.classes
        def splits(self):
            return self.inner.splits()
        def fingerprint(self):
            return self.inner.fingerprint()
        def item(self, split, index):
            time.sleep(0.004)
            return self.inner.item(split, index)

    write_shards(Slow(unique_label_source()), {out!r}, ShardOptions(max_count=64, workers=1, progress=False))
    """
)


def test_killed_run_resumes_to_the_same_result(tmp_path):
    reference = tmp_path / "reference"
    write_shards(unique_label_source(), reference, OPTS)
    out = tmp_path / "out"
    script = KILL_SCRIPT.format(root=str(Path(__file__).parents[2]), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script])
    work = out / ".fastdata-work"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(work.glob("*.done.json"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = sorted(p.name for p in work.glob("*.done.json"))
    assert 2 <= len(finished) < 6, "the kill should land mid-run"
    assert not (out / "manifest.json").exists()
    for tar in out.glob("*.tar"):  # a tar under its final name is always complete, with its index
        assert tar.with_suffix(".idx").exists()
        with tarfile.open(tar) as t:
            assert len(t.getmembers()) % 3 == 0
    write_shards(unique_label_source(), out, OPTS)
    assert _files(out) == _files(reference)
    for name in _files(reference):
        assert filecmp.cmp(out / name, reference / name, shallow=False), name


def test_folder_keeps_jpeg_bytes_and_converts_png(tmp_path):
    wds = pytest.importorskip("webdataset")  # absent on the bare GPU machine
    root = write_jpeg_folder(tmp_path / "images")
    manifest = write_shards(FolderSource(root), tmp_path / "out", OPTS)
    split = next(iter(manifest.splits.values()))
    assert split.encoding == "mixed" and split.num_samples == 12
    jpgs = {str(p): p.read_bytes() for p in root.rglob("*.jpg")}
    found = 0
    for sample in wds.WebDataset([manifest.shard_url(s) for s in split.shards], shardshuffle=False):
        if "jpg" in sample:
            assert sample["jpg"] in jpgs.values()
            found += 1
        else:
            assert sample["png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert found == len(jpgs) == 9


def _corrupt_folder(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = write_jpeg_folder(tmp_path / "images")
    truncated = root / "class0" / "img0.jpg"
    truncated.write_bytes(truncated.read_bytes()[:200])
    garbage = root / "class1" / "img1.jpg"
    garbage.write_bytes(b"this is not an image")
    return root, truncated, garbage


def test_bad_images_are_skipped_and_reported(tmp_path, caplog):
    root, truncated, garbage = _corrupt_folder(tmp_path)
    # 2 bad of 12 inputs: above the default max_bad (10%), so the test allows 20%.
    opts = ShardOptions(**{**OPTS.__dict__, "max_bad": 0.2})
    manifest = write_shards(FolderSource(root), tmp_path / "out", opts)
    split = next(iter(manifest.splits.values()))
    assert split.num_samples == 10
    origins = {s.origin for s in split.skipped}
    assert any(str(truncated.name) in o for o in origins) and any(
        str(garbage.name) in o for o in origins
    )
    assert "skipped 2 bad source sample" in caplog.text


def test_strict_stops_without_leaving_partial_shards(tmp_path):
    root, _, _ = _corrupt_folder(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ShardingError, match=r"strict.*img\d\.jpg"):
        write_shards(
            FolderSource(root),
            out,
            ShardOptions(max_count=4, workers=2, strict=True, progress=False),
        )
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.tmp-*"))
    done = {json.loads(p.read_text())["name"] for p in (out / ".fastdata-work").glob("*.done.json")}
    assert {p.name for p in out.glob("*.tar")} == done  # only finished shards, each recorded


def test_manifest_records_counts_checksums_and_stats(tmp_path):
    manifest = write_shards(unique_label_source(n_train=90, n_test=10), tmp_path / "out", OPTS)
    loaded = load_manifest(tmp_path / "out")
    assert loaded.to_json() == manifest.to_json()
    train = loaded.split("train")
    assert sum(train.class_counts) == 90 and loaded.num_classes == 90
    assert train.image_stats["mean_height"] == 8
    from fastdata.write.tarshard import sha256_file

    for shard in train.shards:
        assert sha256_file(Path(loaded.shard_url(shard))) == shard.sha256
        assert Path(loaded.shard_url(shard)).stat().st_size == shard.bytes
