"""`VideoDataModule` over a mix of video datasets (`fastdata.read.clips.clip_mix`): each
dataset counted in clips, exact per-epoch (and scheduled per-batch) counts, every planned clip
once over the ranks, equal batches, exact and elastic resume; a video + image mix refused.

Two tiny datasets of different frame sizes, with disjoint classes so a clip's label names its
dataset: A (classes up, down; 4 train videos of 32x32) and B (class side; 3 of 40x24).
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from fastdata import Schedule, ShardSet
from fastdata.lightning.family_video import VideoDataModule
from fastdata.read.clips import ClipSampling
from fastdata.read.resume import ResumeError
from fastdata.read.schedule import share_counts
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from tests.conftest import write_jpeg_folder
from tests.video.clips import Clip, make_tree
from tests.video.test_read_clips import _module

#: test_read_clips' module: 2 clips of 3 frames per video, at 16 px, keys, no workers.
_mixed = partial(_module, drop_last=False)
N = 2  # clips per video
CLIPS = ClipSampling(frames=3, stride=2, clips=N)
SIDE = 16
#: Train videos of each dataset (the writer carves 0.3 of each into val).
A_VIDEOS, B_VIDEOS = 4, 3


def _dataset(tmp: Path, name: str, classes: dict[str, list[tuple[str, Clip]]]) -> Path:
    options = ShardOptions(max_count=2, workers=1, progress=False, val_fraction=0.3)
    out = tmp / name
    write_shards(open_source("video", make_tree(tmp / f"{name}-videos", classes)), out, options)
    return out


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("video-mix")
    a = _dataset(
        tmp,
        "A",
        {
            "up": [(f"a{i}.mp4", Clip(frames=12 + i, axis=0, direction=-1)) for i in range(3)],
            "down": [(f"a{i}.mp4", Clip(frames=14 + i, axis=0)) for i in range(3, 6)],
        },
    )
    side = [(f"b{i}.mp4", Clip(frames=10 + i, width=40, height=24)) for i in range(5)]
    b = _dataset(tmp, "B", {"side": side})
    return a, b


def _clips(dm: VideoDataModule, train: bool = True, limit: int | None = None) -> list[tuple]:
    """(label, key, first frame) of every clip read (None for padding); each batch checked."""
    out = []
    loader = dm.train_dataloader() if train else dm.val_dataloader()
    for number, batch in enumerate(loader):
        if number == limit:
            break
        x, labels, ids = batch
        assert x.shape[1:] == (CLIPS.frames, 3, SIDE, SIDE)  # both frame sizes stack
        for label, key, start in zip(labels.tolist(), ids["key"], ids["start"], strict=True):
            out.append(None if key is None else (label, key, start))
        if train:
            dm.on_after_batch_transfer(batch, 0)  # the step counted, as a Trainer would
    return out


def _from_b(clips: list[tuple]) -> int:
    return sum(1 for clip in clips if clip is not None and clip[0] == 2)  # B's class: "side"


def test_each_dataset_counts_its_clips_and_every_planned_clip_is_read_once(mix):
    roots = [ShardSet(str(mix[0]), weight=3), ShardSet(str(mix[1]))]
    whole = _clips(_mixed(roots))
    total = N * (A_VIDEOS + B_VIDEOS)  # 14 clips: A gets 11 (up-sampled), B 3 (down-sampled)
    assert len(whole) == total
    assert _from_b(whole) == share_counts(total, [3.0, 1.0])[1] == 3
    per_rank = [_clips(_mixed(roots, rank, 2)) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])  # equal batches on both ranks
    assert Counter(per_rank[0] + per_rank[1]) == Counter(whole)
    dm = _mixed(roots)
    dm.setup()
    assert dm.classes == ["down", "up", "side"]
    assert dm.state_dict()["num_samples"] == total


def test_epoch_samples_counts_clips(mix):
    dm = _mixed([str(r) for r in mix], epoch_samples=9)
    clips = _clips(dm)
    assert len(clips) == 9 and _from_b(clips) == share_counts(9, [1.0, 1.0])[1]


@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_reads_every_uniform_clip_of_both_datasets_once(mix, world):
    seen: Counter = Counter()
    lengths = set()
    for rank in range(world):
        clips = _clips(_mixed([str(r) for r in mix], rank, world), train=False)
        lengths.add(len(clips))
        seen.update(clip for clip in clips if clip is not None)
    assert len(lengths) == 1
    dm = _mixed([str(r) for r in mix])
    dm.setup()
    assert len(seen) == N * dm.manifest.split("val").num_samples and set(seen.values()) == {1}
    assert 0 < _from_b(list(seen)) < len(seen)


def test_resume_mid_epoch_on_another_world_size(mix):
    roots = [ShardSet(str(mix[0]), weight=2), ShardSet(str(mix[1]))]
    whole = _clips(_mixed(roots))
    ranks = [_mixed(roots, rank, 2) for rank in range(2)]
    taken = [clip for dm in ranks for clip in _clips(dm, limit=1)]
    state = ranks[0].state_dict()
    assert state["consumed"] == 4
    for world in (1, 2):  # another world size, and the same
        resumed = [_mixed(roots, rank, world) for rank in range(world)]
        for dm in resumed:
            dm.load_state_dict(state)
        rest = [_clips(dm) for dm in resumed]
        if world == 1:
            assert rest[0] == whole[4:]  # the uninterrupted run's remaining clips, in order
        assert len({len(part) for part in rest}) == 1
        read = Counter(taken) + Counter(clip for part in rest for clip in part)
        assert read == Counter(whole)  # every clip once, none lost


def test_a_state_of_another_clip_count_is_refused(mix):
    """Row r is clip r % N of video r // N: a state saved with N = 2 means other clips with
    N = 3, even with the same epoch size."""
    roots = [str(r) for r in mix]
    saved = _mixed(roots, epoch_samples=12)
    _clips(saved, limit=1)
    state = saved.state_dict()
    other = _mixed(roots, epoch_samples=12, clips=ClipSampling(frames=3, stride=2, clips=3))
    with pytest.raises(ResumeError, match="fingerprint|another"):
        other.load_state_dict(state)
        other.setup()
        _clips(other, limit=1)
    same = _mixed(roots, epoch_samples=12)
    same.load_state_dict(state)
    assert _clips(same)  # the same N resumes


def test_a_scheduled_weight_gives_exact_clip_counts_per_batch(mix):
    ramp = Schedule([(0, 1.0), (8, 3.0)])
    roots = [ShardSet(str(mix[0]), weight=ramp), ShardSet(str(mix[1]))]
    clips = _clips(_mixed(roots))
    assert len(clips) == N * (A_VIDEOS + B_VIDEOS)
    for start in range(0, len(clips), 2):  # one batch of 2: B gives 1 before position 8, then 0
        block = clips[start : start + 2]
        assert _from_b(block) == share_counts(2, [ramp(start), 1.0])[1], (start, block)
    assert _from_b(clips) == 4


def test_a_video_and_an_image_dataset_are_refused_naming_both(mix, tmp_path: Path):
    images = tmp_path / "images"
    source = open_source("folder", write_jpeg_folder(tmp_path / "jpegs", classes=2, per_class=2))
    write_shards(source, images, ShardOptions(workers=1, progress=False))
    dm = _mixed([str(mix[0]), str(images)])
    with pytest.raises(ValueError, match="cannot mix video and image datasets") as error:
        dm.setup()
    assert str(mix[0]) in str(error.value) and str(images) in str(error.value)
