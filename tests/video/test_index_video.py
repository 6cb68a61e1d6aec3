"""`fastdata index` of other tools' tars holding mp4/webm members: read in place as clips."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdata.read.base import WorkerSettings
from fastdata.read.clips import ClipSampling
from fastdata.write.index import index_shards
from fastdata.write.index_splits import IndexingError
from tests.video.clips import Clip, make_video
from tests.write.index.conftest import solid_jpeg

wds = pytest.importorskip("webdataset")
pytest.importorskip("av")


def _tars(tmp_path: Path, extra: dict | None = None) -> Path:
    out = tmp_path / "wds"
    out.mkdir()
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(5):
            ext = "webm" if i == 4 else "mp4"
            codec = "libvpx-vp9" if ext == "webm" else "libx264"
            video = make_video(tmp_path / f"{i}.{ext}", Clip(codec=codec, frames=12 + i))
            sink.write({"__key__": f"v{i:03d}", ext: video.read_bytes(), "cls": str(i % 2)})
            if extra:
                sink.write({"__key__": f"x{i:03d}", **extra})
    return out


def test_foreign_video_tars_are_read_as_clips(tmp_path: Path):
    from fastdata.lightning.family_video import VideoDataModule

    manifest = index_shards(_tars(tmp_path), tmp_path / "index")
    assert manifest.split("train").encoding == "video"
    dm = VideoDataModule(
        tmp_path / "index",
        clips=ClipSampling(frames=3, clips=2, mode="uniform"),
        image_size=16,
        batch_size=4,
        keys=True,
        workers=WorkerSettings(num_workers=0),
        drop_last=False,
    )
    seen = []
    for x, y, ids in dm.prepared(dm.train_dataloader()):
        assert x.shape[1:] == (3, 3, 16, 16)
        seen += list(zip(ids["key"], ids["start"], y.tolist(), strict=True))
    assert len(seen) == 10 and len(set(seen)) == 10  # 5 videos x 2 uniform clips, each once
    assert {(k, label) for k, _, label in seen} == {(f"v{i:03d}", i % 2) for i in range(5)}
    starts = {k: sorted(s for kk, s, _ in seen if kk == k) for k, _, _ in seen}
    assert starts["v000"] == [0, 9] and starts["v004"] == [0, 13]  # frames 12 and 16, T=3
    from fastdata.read.verify import verify

    assert verify(tmp_path / "index", progress=False).ok  # the index read from each video


def test_videos_beside_images_in_one_split_are_refused(tmp_path: Path):
    with pytest.raises(IndexingError, match="video members"):
        index_shards(_tars(tmp_path, {"jpg": solid_jpeg(0), "cls": "0"}), tmp_path / "index")
