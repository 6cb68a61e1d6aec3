"""Clips as samples: frames picked from the clip index, decoded from the key frame before them,
planned like images (equal batches, once-only evaluation, exact and elastic resume)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata.format.video import ClipIndex
from fastdata.read.base import WorkerSettings
from fastdata.read.clips import ClipSampling, clip_frames
from fastdata.read.decoders.video import decode_clip
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from fastdata.write.video import probe_video
from tests.video.clips import Clip, make_video

av = pytest.importorskip("av")

KINDS = {
    "gop.mp4": Clip(frames=40, gop=8),
    "odd.webm": Clip(codec="libvpx-vp9", width=33, height=47, gop=10),
    "vfr.mp4": Clip(vfr=True, frames=30),
    "rot.mp4": Clip(rotation=90, width=40, height=24),
    # B-frames: the frames a clip does not keep are skipped when nothing refers to them
    "bframes.mp4": Clip(frames=48, gop=24, bframes=3),
    # AV1 (libdav1d buffers packets: it must not be told to skip any)
    "av1.mp4": Clip(codec="libsvtav1", frames=48, gop=24, width=64, height=64),
}


def _every_frame(data: bytes, index: ClipIndex, side: int) -> np.ndarray:
    """Every frame decoded front to back (no seek), for reference."""
    return decode_clip(data, index, np.arange(index.frames), side)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_clip_decoded_after_a_seek_equals_the_same_frames_decoded_from_the_start(
    name: str, tmp_path: Path
):
    data = make_video(tmp_path / name, KINDS[name]).read_bytes()
    index = probe_video(data, name, None)
    assert index.codec in {"h264", "vp9", "av1"}  # the codec's name, not its decoder's
    every = _every_frame(data, index, 20)
    late = [min(f, index.frames - 1) for f in (30, 26, 34)]  # after the 2nd key frame of 48
    for frames in ([17, 18, 19], [9, 3, 3, 21], [index.frames - 1], [8, 16, 23], late):
        clip = decode_clip(memoryview(data), index, np.array(frames), 20)
        assert np.array_equal(clip, every[frames]), frames
    assert every.shape == (index.frames, 3, 20, 20)


def test_rotation_is_applied(tmp_path: Path):
    plain = make_video(tmp_path / "p.mp4", Clip(width=40, height=24)).read_bytes()
    turned = make_video(tmp_path / "r.mp4", Clip(width=40, height=24, rotation=90)).read_bytes()
    a, b = (probe_video(d, "x", None) for d in (plain, turned))
    assert b.display_hw == (40, 24) and a.display_hw == (24, 40)
    fa = decode_clip(plain, a, np.array([5]), 24)[0].astype(int)
    fb = decode_clip(turned, b, np.array([5]), 24)[0].astype(int)
    # the square moves along columns in the stored frames, along rows once turned
    assert np.argmax(fa.mean(axis=(0, 1))) != 0 or np.argmax(fb.mean(axis=(0, 2))) != 0
    assert not np.array_equal(fa, fb)


def _index(frames: int, pts_step=1, fps=10.0) -> ClipIndex:
    pts = np.arange(frames, dtype=np.int64) * pts_step
    return ClipIndex("h264", 8, 8, 0, (1, 10 * pts_step), pts, np.array([0]), fps)


def test_clip_frames_stride_uniform_random_and_short_videos():
    index = _index(50)
    uniform = ClipSampling(frames=4, stride=3, clips=3, mode="uniform")
    starts = [int(clip_frames(index, uniform, j, None)[0]) for j in range(3)]
    assert starts == [0, 20, 40]  # evenly spaced from the first to the last possible start
    assert clip_frames(index, uniform, 1, None).tolist() == [20, 23, 26, 29]
    rng = np.random.default_rng(0)
    drawn = [int(clip_frames(index, uniform, 0, rng)[0]) for _ in range(200)]
    assert min(drawn) >= 0 and max(drawn) == 40 and len(set(drawn)) > 30
    short = clip_frames(_index(5), ClipSampling(frames=4, stride=2), 0, None)
    assert short.tolist() == [0, 2, 4, 4]  # the last frame repeated


def test_clip_frames_at_a_target_rate_follow_timestamps():
    # variable frame rate: frames at 0, 0.1, 0.15, 0.25, 0.3, ... s
    pts = np.array([0, 100, 150, 250, 300, 400, 450, 550, 600, 700])
    index = ClipIndex("h264", 8, 8, 0, (1, 1000), pts, np.array([0]), 14.3)
    frames = clip_frames(index, ClipSampling(frames=4, fps=5.0, clips=1, mode="uniform"), 0, None)
    # start = (0.7 - 0.6) / 2 = 0.05 s; instants 0.05, 0.25, 0.45, 0.65 s
    assert frames.tolist() == [0, 3, 6, 8]


def _zoo(root: Path, count: int = 7) -> Path:
    for i in range(count):
        label = ("up", "down")[i % 2]
        (root / label).mkdir(parents=True, exist_ok=True)
        clip = Clip(frames=16 + 4 * i, axis=0, direction=1 if i % 2 else -1, gop=6)
        make_video(root / label / f"v{i}.mp4", clip)
    return root


@pytest.fixture(scope="module")
def clip_shards(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("clips")
    out = tmp / "shards"
    options = ShardOptions(max_count=3, workers=1, progress=False, val_fraction=0.3)
    write_shards(open_source("video", _zoo(tmp / "videos")), out, options)
    return out


def _module(root: Path, rank=0, world=1, **kwargs):
    from fastdata.lightning.family_video import VideoDataModule

    kwargs.setdefault("clips", ClipSampling(frames=3, stride=2, clips=2))
    kwargs.setdefault("workers", WorkerSettings(num_workers=0))
    return VideoDataModule(
        root, image_size=16, batch_size=2, keys=True, rank=rank, world_size=world, **kwargs
    )


def _ids(batch) -> list[tuple[str, int] | None]:
    ids = batch[2]
    return [None if k is None else (k, s) for k, s in zip(ids["key"], ids["start"], strict=True)]


@pytest.mark.parametrize("world", [1, 3])
def test_evaluation_reads_every_uniform_clip_once_with_equal_batches(clip_shards: Path, world):
    seen: Counter = Counter()
    lengths = set()
    for rank in range(world):
        dm = _module(clip_shards, rank, world, drop_last=False)
        batches = list(dm.val_dataloader())
        lengths.add(len(batches))
        for batch in batches:
            labels = batch[1]
            for i, ident in enumerate(_ids(batch)):
                assert (ident is None) == (int(labels[i]) == -100)
                if ident is not None:
                    seen[ident] += 1
    assert len(lengths) == 1  # every rank the same number of batches
    dm = _module(clip_shards)
    dm.setup()
    count = dm.manifest.split("val").num_samples
    assert len(seen) == count * 2 and set(seen.values()) == {1}


def _train_ids(dm, limit=None):
    out, x = [], []
    for number, batch in enumerate(dm.train_dataloader()):
        if limit is not None and number == limit:
            break
        out += _ids(batch)
        x.append(batch[0])
        dm.on_after_batch_transfer(batch, 0)  # the step counted, as a Trainer would
    return out, x


def test_resume_mid_epoch_on_another_world_size(clip_shards: Path):
    whole, _ = _train_ids(_module(clip_shards, drop_last=False))
    ranks = [_module(clip_shards, r, 2, drop_last=False) for r in range(2)]
    taken = []
    for dm in ranks:
        ids, _ = _train_ids(dm, limit=1)
        taken += ids
    state = ranks[0].state_dict()
    assert state["consumed"] == 4
    resumed = _module(clip_shards, drop_last=False)
    resumed.load_state_dict(state)
    rest, _ = _train_ids(resumed)
    assert Counter(taken) + Counter(rest) == Counter(whole)  # every clip once, none lost
    assert rest == whole[4:]  # and in the uninterrupted run's order


def test_random_clips_follow_the_seed_and_change_with_the_epoch(clip_shards: Path):
    dm = _module(clip_shards, seed=3)
    first, x1 = _train_ids(dm)
    workers = WorkerSettings(num_workers=2, persistent_workers=False)
    again, x2 = _train_ids(_module(clip_shards, seed=3, workers=workers))
    assert first == again and all(torch.equal(a, b) for a, b in zip(x1, x2, strict=True))
    later, _ = _train_ids(dm)  # the next epoch: other clips
    assert sorted(k for k, _ in first) == sorted(k for k, _ in later) and first != later
    loader = dm.loader_spec("train", True)
    assert loader.shard_sizes == tuple(2 * n for n in loader.video_sizes)


def test_the_device_crop_and_flip_are_the_same_for_every_frame(clip_shards: Path):
    from fastdata.lightning.family_video import video_preset

    frame = torch.randint(0, 255, (4, 1, 3, 16, 16), dtype=torch.uint8)
    clips = frame.expand(4, 5, 3, 16, 16).contiguous()
    out = video_preset(12).apply(clips, True, torch.Generator().manual_seed(0))
    assert out.shape == (4, 5, 3, 12, 12)
    assert all(torch.equal(out[:, t], out[:, 0]) for t in range(5))
    assert not torch.equal(out[0, 0], out[1, 0])  # but each clip its own draw


def test_import_fastdata_without_av_and_a_clear_error_where_video_is_used(tmp_path: Path):
    code = (
        "import sys; sys.modules['av'] = None\n"
        "import fastdata, fastdata.write, fastdata.read.backends.video\n"
        "from fastdata.format.video import require_av\n"
        "try:\n    require_av()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "fastdata[video]" in out.stdout


def test_a_bad_clip_index_at_read_time_is_named_or_skipped(tmp_path: Path):
    from fastdata.format.integrity import ShardReadError
    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.backends.video import make_video_loader
    from fastdata.read.clips import ClipSpec

    out = tmp_path / "shards"
    write_shards(
        open_source("video", _zoo(tmp_path / "v", 4)), out, ShardOptions(workers=1, progress=False)
    )
    tar = next(out.glob("train-*.tar"))
    data = tar.read_bytes()
    tar.write_bytes(data.replace(b'{"codec"', b'{"xodec"', 1))  # one sample's index, same size

    def clips(on_error: str) -> tuple[int, int]:
        spec = ClipSpec(
            manifest=load_manifest(out), split="train", train=False, batch_size=4,
            image_size=16, on_error=on_error, clips=ClipSampling(frames=2),
        )  # fmt: skip
        loader = make_video_loader(spec)
        count = sum(len(y) for _, y in loader)
        return count, loader.skipped

    assert clips("skip") == (3, 1)
    with pytest.raises(ShardReadError, match=r"train_0000000\d.*clip index"):
        clips("raise")


def test_workers_forked_after_this_process_decoded_clips_do_not_hang(clip_shards: Path):
    # swscale's default thread pool, kept in a reused converter, once left forked workers
    # waiting for ever on threads that do not exist in them.
    main = _module(clip_shards)
    next(iter(main.val_dataloader()))  # decoded here (no workers)
    forked = _module(clip_shards, workers=WorkerSettings(num_workers=2, timeout=60))
    assert len(list(forked.val_dataloader())) == len(list(main.val_dataloader()))
    forked.teardown()


@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_the_source_window_turned_is_the_centre_square_decode_clip_keeps(rotation):
    from fastdata.read.decoders.video import _scaled_size, source_window

    index = ClipIndex("vp9", 41, 25, rotation, (1, 10), np.arange(2), np.array([0]), 10.0)
    side = 11
    width, height = _scaled_size(index, side)
    scaled = np.arange(width * height).reshape(height, width)  # the scaled, unturned frame
    shown = np.rot90(scaled, k=rotation // 90)
    top, left = (shown.shape[0] - side) // 2, (shown.shape[1] - side) // 2
    expected = shown[top : top + side, left : left + side]
    y0, x0, y1, x1 = source_window(index, side)
    sy, sx = height / index.height, width / index.width
    rows, cols = round(y0 * sy), round(x0 * sx)
    assert (round(y1 * sy) - rows, round(x1 * sx) - cols) == (side, side)
    window = scaled[rows : rows + side, cols : cols + side]
    assert np.array_equal(np.rot90(window, k=rotation // 90), expected)


@pytest.mark.parametrize("workers", [0, 1])
def test_each_clip_batch_reports_what_it_cost_to_make(clip_shards: Path, workers: int):
    """The read and decode seconds of each batch reach the loader (`last_stages`), so
    `LoaderMonitor` sizes video workers from the loop's measured load as for images."""
    dm = _module(clip_shards, workers=WorkerSettings(num_workers=workers))
    loader = dm.train_dataloader()
    for _ in loader:
        read_s, decode_s = loader.last_stages
        assert read_s >= 0 and decode_s > 0


def test_a_state_of_another_clip_count_is_refused_naming_it(clip_shards: Path):
    from fastdata.read.resume import ResumeError

    saved = _module(clip_shards)
    batch = next(iter(saved.train_dataloader()))
    saved.on_after_batch_transfer(batch, 0)  # the step counted, as a Trainer would
    other = _module(clip_shards, clips=ClipSampling(frames=3, stride=2, clips=3))
    with pytest.raises(ResumeError, match=r"the same shards.*ClipSampling\.clips"):
        other.load_state_dict(saved.state_dict())
        other.train_dataloader()
