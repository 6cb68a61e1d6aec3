"""`fastdata shard video`: videos stored as they are, with a clip index read from the container."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.format.video import ClipIndex, ClipIndexError
from fastdata.read.shardio import ShardReader
from fastdata.write import ShardOptions, write_shards
from fastdata.write.errors import ShardingError
from fastdata.write.sources import open_source
from tests.video.clips import Clip, make_video
from tests.video.conftest import ZOO

OPTIONS = ShardOptions(max_count=4, workers=1, progress=False, max_bad=0.5)


def _samples(out: Path) -> dict[str, dict[str, bytes]]:
    """source id (path under the tree) -> the sample's components."""
    manifest = load_manifest(out)
    reader = ShardReader(manifest, "train")
    found = {}
    for shard, info in enumerate(manifest.split("train").shards):
        for index in range(info.num_samples):
            parts = {k: bytes(v) for k, v in reader.sample(shard, index).items()}
            found[reader.key(shard, index)] = parts
    reader.close()
    return found


def test_videos_are_stored_unchanged_with_their_clip_index(video_tree: Path, tmp_path: Path):
    out = tmp_path / "shards"
    manifest = write_shards(open_source("video", video_tree), out, OPTIONS)
    split = manifest.split("train")
    assert split.encoding == "video"
    assert split.num_samples == 6  # the truncated file is skipped and listed
    assert [Path(s.origin).name for s in split.skipped] == ["broken.mp4"]
    files = {p.read_bytes(): p for p in video_tree.rglob("*.*") if p.name != "broken.mp4"}
    seen = {}
    for parts in _samples(out).values():
        ext = "mp4" if "mp4" in parts else "webm"
        original = files[parts[ext]]  # byte-identical: never re-encoded
        index = ClipIndex.from_json(parts["vidx"])
        seen[original.name] = index
        clip = dict(ZOO[original.parent.name])[original.name]
        assert index.frames == clip.frames
        assert (index.width, index.height) == (clip.width, clip.height)
        assert int(parts["cls"]) == manifest.classes.index(original.parent.name)
    assert seen["rotated.mp4"].rotation == 90 and seen["h264.mp4"].rotation == 0
    assert seen["vp9_odd.webm"].codec == "vp9" and seen["h264.mp4"].codec == "h264"
    assert seen["h264.mp4"].keys.tolist() == [0, 8, 16]  # gop 8
    assert seen["long.mp4"].keys.tolist() == [0, 16, 32, 48]
    vfr = np.diff(seen["vfr.mp4"].seconds())
    assert np.allclose(sorted(set(np.round(vfr, 3))), [0.05, 0.12])  # variable frame rate kept
    assert seen["h264.mp4"].fps == 12 and seen["h264.mp4"].duration == pytest.approx(2.0)


def test_strict_stops_at_the_truncated_video(video_tree: Path, tmp_path: Path):
    options = ShardOptions(max_count=4, workers=1, progress=False, strict=True)
    with pytest.raises(ShardingError, match="broken.mp4"):
        write_shards(open_source("video", video_tree), tmp_path / "out", options)


def test_size_limits_make_bad_samples(tmp_path: Path):
    root = tmp_path / "v"
    (root / "a").mkdir(parents=True)
    make_video(root / "a" / "big.mp4", Clip(width=64, height=64))
    make_video(root / "a" / "small.mp4", Clip())
    (root / "a" / "text.mp4").write_text("not a video at all")
    options = ShardOptions(workers=1, progress=False, max_pixels=40 * 40, max_bad=1.0)
    manifest = write_shards(open_source("video", root), tmp_path / "out", options)
    reasons = {Path(s.origin).name: s.reason for s in manifest.split("train").skipped}
    assert manifest.split("train").num_samples == 1
    assert "max_pixels" in reasons["big.mp4"] and "not an MP4" in reasons["text.mp4"]
    source = open_source("video", root, max_video_bytes=100)
    manifest = write_shards(source, tmp_path / "out2", options)
    assert manifest.split("train").num_samples == 0 or all(
        "max_video_bytes" in s.reason for s in manifest.split("train").skipped
    )


def test_a_list_file_with_splits(video_tree: Path, tmp_path: Path):
    lines = ["path,label,split", "left/h264.mp4,left,train", "right/long.mp4,right,val"]
    (video_tree / "list.csv").write_text("\n".join(lines) + "\n")
    manifest = write_shards(open_source("video", video_tree / "list.csv"), tmp_path / "o", OPTIONS)
    assert {s: manifest.split(s).num_samples for s in manifest.splits} == {"train": 1, "val": 1}
    assert manifest.classes == ["left", "right"]


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(pts=[3, 2, 1]),
        lambda d: d.update(keys=[1]),
        lambda d: d.update(rotation=45),
        lambda d: d.update(width="32"),
        lambda d: d.pop("fps"),
    ],
)
def test_a_bad_clip_index_is_refused(edit):
    good = {"codec": "h264", "width": 32, "height": 32, "rotation": 0, "time_base": [1, 12]}
    good |= {"fps": 12.0, "pts": [0, 1, 2], "keys": [0]}
    assert ClipIndex.from_json(json.dumps(good).encode()).frames == 3
    edit(good)
    with pytest.raises(ClipIndexError):
        ClipIndex.from_json(json.dumps(good).encode())


def test_the_command_line(video_tree: Path, tmp_path: Path, capsys):
    from fastdata.cli import main

    out = tmp_path / "cli"
    args = ["shard", "video", str(video_tree), str(out), "--no-progress", "--max-bad", "0.5"]
    assert main([*args, "--max-video-bytes", "1MB"]) == 0
    assert load_manifest(out).split("train").num_samples == 6
    assert main(["verify", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    folder = ["shard", "folder", str(video_tree), str(tmp_path / "x"), "--max-video-bytes", "1MB"]
    assert main(folder) != 0
    assert "--max-video-bytes is for the video source" in capsys.readouterr().err


def test_a_webm_cut_short_of_its_stated_duration_is_skipped(tmp_path: Path):
    root = tmp_path / "v"
    (root / "a").mkdir(parents=True)
    make_video(root / "a" / "whole.webm", Clip(codec="libvpx-vp9", frames=24))
    cut = make_video(root / "a" / "cut.webm", Clip(codec="libvpx-vp9", frames=24))
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])  # the header still says 2 s
    options = ShardOptions(workers=1, progress=False, max_bad=0.5)
    manifest = write_shards(open_source("video", root), tmp_path / "out", options)
    (skipped,) = manifest.split("train").skipped
    assert Path(skipped.origin).name == "cut.webm" and "truncated" in skipped.reason


def test_a_folder_of_photos_is_refused_naming_the_video_extensions(tmp_path: Path):
    from fastdata.write.sources import BadSourceError
    from tests.conftest import write_jpeg_folder

    photos = write_jpeg_folder(tmp_path / "photos")
    with pytest.raises(BadSourceError, match=r"no files in its class folders") as caught:
        open_source("video", photos)
    message = str(caught.value)
    assert ".mp4" in message and ".webm" in message and ".jpg" not in message


def test_parts_then_merge_equal_one_run(video_tree: Path, tmp_path: Path):
    from fastdata.cli import main

    words = ["shard", "video", str(video_tree)]
    flags = ["--max-count", "2", "--val-fraction", "0.3", "--max-bad", "0.5", "--no-progress"]
    assert main([*words, str(tmp_path / "one"), *flags]) == 0
    for part in ("2/3", "0/3", "1/3"):  # 4 shards: train 3 (planned with the broken video), val 1
        assert main([*words, str(tmp_path / "parts"), *flags, "--part", part]) == 0
    assert main(["merge", str(tmp_path / "parts")]) == 0
    one, parts = load_manifest(tmp_path / "one"), load_manifest(tmp_path / "parts")
    assert {n: s.num_samples for n, s in parts.splits.items()} == {"train": 4, "val": 2}
    assert {n: s.num_samples for n, s in one.splits.items()} == {"train": 4, "val": 2}
    assert [s.origin for s in parts.split("train").skipped] == [
        s.origin for s in one.split("train").skipped
    ]  # the truncated video, counted once
    assert _samples(tmp_path / "parts") == _samples(tmp_path / "one")
    tars = sorted(p.name for p in (tmp_path / "one").glob("*.tar"))
    assert len(tars) == 4 and tars == sorted(p.name for p in (tmp_path / "parts").glob("*.tar"))
    for name in tars:
        assert (tmp_path / "parts" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
