"""The DALI video loader on DALI's CPU operators (``device_id=None``): VP9 clips decoded by
``fn.decoders.video``, H.264 clips by the CPU fallback (PyAV), batches as the cpu loader's.

Tolerance: both paths decode with FFmpeg (the decoded frames agree within 2 grey levels), but
the cpu loader scales with swscale's area filter and DALI with its antialiased linear one: on
these synthetic frames (a sharp bright square on a dark ground, the worst case for a filter
change) each frame is within `MEAN_TOLERANCE` grey levels on average, and the square's centre is
within 0.4 pixel of the cpu frame's (the next frame's is 0.8 to 1.3 pixels away). Fallback clips are decoded by the cpu loader's own code: equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdata.format.manifest_io import load_manifest
from fastdata.format.video import ClipIndex
from fastdata.read.backends.dali.video import make_dali_video_loader
from fastdata.read.backends.video import make_video_loader
from fastdata.read.base import WorkerSettings
from fastdata.read.clips import ClipSampling, ClipSpec
from fastdata.read.shardio import ShardReader
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from tests.video.clips import Clip, make_tree

#: Mean absolute difference per frame, grey levels, DALI against the cpu loader (measured:
#: 0.7-2.5 on these frames, sides 12-48).
MEAN_TOLERANCE = 3.0
SIDE = 16
VP9 = "libvpx-vp9"
VIDEOS: dict[str, list[tuple[str, Clip]]] = {
    "left": [
        ("a.webm", Clip(codec=VP9, frames=20, width=32, height=32, gop=6, direction=-1)),
        ("b.webm", Clip(codec=VP9, frames=16, width=33, height=47, gop=5, direction=-1)),
        ("h.mp4", Clip(frames=18, gop=6, direction=-1)),  # H.264: the CPU fallback
    ],
    "right": [
        ("c.webm", Clip(codec=VP9, frames=24, width=64, height=40, gop=8)),
        ("r.mp4", Clip(codec=VP9, frames=16, width=40, height=24, rotation=90)),  # VP9, turned
        ("g.mp4", Clip(frames=20, gop=10)),  # H.264
    ],
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dali_video")
    out = tmp / "shards"
    options = ShardOptions(max_count=4, workers=1, progress=False)
    write_shards(open_source("video", make_tree(tmp / "videos", VIDEOS)), out, options)
    return out


def _spec(root: Path, **kw) -> ClipSpec:
    base = dict(
        manifest=load_manifest(root), split="train", train=True, batch_size=4, seed=7,
        image_size=SIDE, keys=True, clips=ClipSampling(frames=3, stride=2, clips=2),
        workers=WorkerSettings(num_workers=0),
    )  # fmt: skip
    base.update(kw)
    return ClipSpec(**base)


def _codecs(root: Path) -> dict[str, ClipIndex]:
    """Each video's key -> its clip index."""
    reader = ShardReader(load_manifest(root), "train")
    return {
        reader.key(shard, i): ClipIndex.from_json(reader.sample(shard, i)["vidx"])
        for shard in range(len(reader.shards))
        for i in range(reader.shards[shard].num_samples)
    }


@pytest.fixture(scope="module")
def h264(shards: Path) -> set[str]:
    """The keys of the H.264 videos (the CPU fallback's)."""
    found = {key for key, index in _codecs(shards).items() if index.codec == "h264"}
    assert len(found) == 2
    return found


def _square(frame: torch.Tensor) -> torch.Tensor:
    """(row, column) of the bright square's centre in a (3, S, S) frame, sub-pixel (NaN: the
    centre crop left it out)."""
    grey = frame.float().mean(dim=0)
    weight = (grey - grey.median() - 8).clamp(min=0)  # the square only, not the ground
    if grey.max() - grey.min() < 100:
        return torch.full((2,), float("nan"))
    at = torch.arange(len(grey), dtype=torch.float32)
    total = weight.sum()
    return torch.stack([(weight.sum(1) * at).sum() / total, (weight.sum(0) * at).sum() / total])


def _assert_close(dali: list, cpu: list, h264: set[str]) -> None:
    """Batch for batch: the same labels and keys; every clip's frames within the tolerance
    with the square at the same place (fallback clips equal)."""
    assert len(dali) == len(cpu)
    for (x, y, ids), (cx, cy, cids) in zip(dali, cpu, strict=True):
        assert torch.equal(y, cy) and ids == cids
        assert x.shape == cx.shape == (len(y), 3, 3, SIDE, SIDE) and x.dtype == torch.uint8
        for clip, other, key in zip(x, cx, ids["key"], strict=True):
            if key in h264:
                assert torch.equal(clip, other), key
                continue
            for frame, expected in zip(clip, other, strict=True):
                diff = (frame.int() - expected.int()).abs().float().mean()
                assert diff <= MEAN_TOLERANCE, (key, float(diff))
                # the same frame: a neighbour's square is >= 0.8 px away at this size
                where, there = _square(frame), _square(expected)
                assert torch.allclose(where, there, atol=0.4, equal_nan=True), (key, where, there)


@pytest.mark.dali
@pytest.mark.parametrize("train", [True, False])
def test_batches_equal_the_cpu_loaders_within_the_filters_tolerance(shards: Path, h264, train):
    spec = _spec(shards, train=train, rank=4, world_size=5)  # 12 clips: eval pads rank 4
    loader = make_dali_video_loader(spec)
    dali = list(loader)
    cpu = list(make_video_loader(spec))
    _assert_close(dali, cpu, h264)
    keys = [k for _, _, ids in dali for k in ids["key"]]
    real = sum(k in h264 for k in keys)  # padding repeats clips, decoded (and counted) too
    assert loader.cpu_fallbacks == real > 0 if train else loader.cpu_fallbacks >= real
    assert (None in keys) == (not train)  # evaluation padding, labelled -100
    assert loader.backend == "cpu" and loader.device_id is None


@pytest.mark.dali
def test_one_pipeline_for_three_epochs(shards: Path, dali_pipelines):
    built = dali_pipelines
    loader = make_dali_video_loader(_spec(shards))
    first = [ids for _, _, ids in loader]
    next(iter(loader))  # a pass abandoned after one batch: the next one starts afresh
    assert [ids for _, _, ids in loader] == first
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        assert len(list(loader)) == len(first)
    assert len(built) == loader.builds == 1


@pytest.mark.dali
def test_batches_of_fallback_clips_only_skip_the_pipeline(shards: Path, h264):
    spec = _spec(shards, train=False, batch_size=1)  # each H.264 clip is a batch of its own
    loader = make_dali_video_loader(spec)
    _assert_close(list(loader), list(make_video_loader(spec)), h264)
    assert loader.cpu_fallbacks == 2 * len(h264)  # two clips of each H.264 video


@pytest.mark.dali
def test_resume_mid_epoch_gives_the_cpu_loaders_remaining_batches(shards: Path, h264):
    spec = _spec(shards)
    loader, cpu = make_dali_video_loader(spec), make_video_loader(spec)
    whole = [ids for _, _, ids in loader]
    loader.set_epoch(0, consumed=2 * spec.batch_size, steps_before=2)
    cpu.set_epoch(0, consumed=2 * spec.batch_size, steps_before=2)
    rest = list(loader)
    assert [ids for _, _, ids in rest] == whole[2:]
    _assert_close(rest, list(cpu), h264)


def test_backend_dali_without_dali_is_a_clear_error(shards: Path, monkeypatch):
    from fastdata.lightning import family_video

    monkeypatch.setattr(family_video, "dali_status", lambda: (False, "ImportError: no dali"))
    dm = family_video.VideoDataModule(shards, backend="dali", batch_size=2)
    with pytest.raises(ValueError, match=r"no dali.*fastdata\[dali\].*backend='cpu'"):
        dm.setup()
    auto = family_video.VideoDataModule(shards, backend="auto", batch_size=2)
    auto.setup()
    assert auto.backend_name == "cpu"  # a CPU training device: the cpu workers


@pytest.mark.parametrize("option", [{"on_error": "skip"}, {"verify_samples": True}])
def test_auto_on_a_gpu_keeps_the_cpu_backend_for_options_dali_cannot_keep(
    shards: Path, monkeypatch, option
):
    import torch

    from fastdata.lightning import family_video

    monkeypatch.setattr(family_video, "training_device", lambda trainer: torch.device("cuda", 0))
    monkeypatch.setattr(family_video, "dali_status", lambda: (True, ""))
    dm = family_video.VideoDataModule(shards, backend="auto", batch_size=2, **option)
    assert dm._choose_backend() == "cpu"
    plain = family_video.VideoDataModule(shards, backend="auto", batch_size=2)
    assert plain._choose_backend() == "dali"  # the same GPU without those options


def test_an_av1_index_is_decoded_by_nvdec_not_the_fallback():
    """Indexes name the codec ("av1"), also those that stored the decoder ("libdav1d")."""
    from fastdata.format.video import ClipIndex
    from fastdata.read.backends.dali.video import DALI_CODECS

    old = b'{"codec": "libdav1d", "width": 8, "height": 8, "rotation": 0, "time_base": [1, 10],'
    old += b' "pts": [0, 1], "keys": [0], "fps": 10.0}'
    index = ClipIndex.from_json(old)
    assert index.codec == "av1"
    assert index.codec in DALI_CODECS["mixed"] and index.codec not in DALI_CODECS["cpu"]


@pytest.mark.dali
def test_the_datamodule_reads_clips_with_dali(shards: Path):
    from fastdata.lightning.family_video import VideoDataModule

    def batches(backend: str) -> list:
        dm = VideoDataModule(
            shards, backend=backend, batch_size=4, seed=3, keys=True, image_size=SIDE,
            clips=ClipSampling(frames=3, stride=2), workers=WorkerSettings(num_workers=0),
        )  # fmt: skip
        return list(dm.train_dataloader())

    dali, cpu = batches("dali"), batches("cpu")
    assert [b[2] for b in dali] == [b[2] for b in cpu]  # keys, starts and source ids
    assert all(len(b[2]["source_id"]) == len(b[1]) for b in dali)


@pytest.mark.dali
def test_a_turned_video_is_turned_as_the_cpu_loader_turns_it(shards: Path, h264):
    spec = _spec(shards, train=False, batch_size=1, keys=True)
    turned = {key for key, index in _codecs(shards).items() if index.rotation == 90}
    assert len(turned) == 1  # r.mp4: VP9, decoded by DALI
    pairs = [
        (d, c)
        for d, c in zip(make_dali_video_loader(spec), make_video_loader(spec), strict=True)
        if d[2]["key"][0] in turned
    ]
    assert len(pairs) == 2
    _assert_close([d for d, _ in pairs], [c for _, c in pairs], h264)
    unturned = torch.rot90(pairs[0][0][0][0, 0], -1, dims=(-2, -1))
    assert not torch.allclose(_square(unturned), _square(pairs[0][1][0][0, 0]), atol=0.4)
