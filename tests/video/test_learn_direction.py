"""The learnable task: which way a square moves (up or down) needs the frames in their order.

A small 3D convolution learns it from `VideoDataModule`'s batches (cpu backend, workers,
device augmentation) well above chance, and stays near chance when every clip's frames are
shuffled in time: what the loader hands over is clips in order, not bags of frames.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastdata.read.base import WorkerSettings
from fastdata.read.clips import ClipSampling
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import open_source
from tests.video.clips import Clip, make_video

pytest.importorskip("av")


@pytest.fixture(scope="module")
def direction_shards(tmp_path_factory) -> Path:
    """24 training and 12 validation videos: a square moving up or down, 20 frames, no wrap."""
    tmp = tmp_path_factory.mktemp("direction")
    for split, count in (("train", 24), ("val", 12)):
        for i in range(count):
            label = ("up", "down")[i % 2]
            folder = tmp / "videos" / split / label
            folder.mkdir(parents=True, exist_ok=True)
            clip = Clip(
                frames=20, width=24, height=48, axis=0, direction=1 if label == "down" else -1,
                offset=i // 2 % 2, gop=5,
            )  # fmt: skip
            make_video(folder / f"{i}.mp4", clip)
    out = tmp / "shards"
    write_shards(open_source("video", tmp / "videos"), out, ShardOptions(workers=1, progress=False))
    return out


class _Motion(nn.Module):
    """Conv over (time, height, width) -> global average -> 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 8, kernel_size=(2, 5, 3), padding=(0, 2, 1))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C, H, W)
        x = torch.relu(self.conv(x.transpose(1, 2)))
        return self.head(x.mean(dim=(2, 3, 4)))


def _shuffled(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    order = torch.stack([torch.randperm(x.shape[1], generator=generator) for _ in range(len(x))])
    return x[torch.arange(len(x))[:, None], order]


def _accuracy(root: Path, shuffle_time: bool) -> float:
    from fastdata.lightning.family_video import VideoDataModule

    torch.manual_seed(0)
    dm = VideoDataModule(
        root,
        clips=ClipSampling(frames=4, stride=2, clips=4),
        image_size=20,
        batch_size=16,
        workers=WorkerSettings(num_workers=2),
    )
    model = _Motion()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):  # epochs of 24 videos x 4 clips
        for x, y in dm.prepared(dm.train_dataloader()):
            x = _shuffled(x, generator) if shuffle_time else x
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    right = total = 0
    with torch.no_grad():
        for x, y in dm.prepared(dm.val_dataloader()):
            x = _shuffled(x, generator) if shuffle_time else x
            keep = y != -100
            right += int((model(x).argmax(1) == y)[keep].sum())
            total += int(keep.sum())
    dm.teardown()
    assert total == 12 * 4  # every val clip once
    return right / total


def test_direction_is_learned_from_ordered_clips_and_not_from_shuffled_frames(direction_shards):
    ordered = _accuracy(direction_shards, shuffle_time=False)
    shuffled = _accuracy(direction_shards, shuffle_time=True)
    print(f"direction accuracy: ordered {ordered:.3f}, shuffled in time {shuffled:.3f}")
    assert ordered >= 0.9, ordered
    assert shuffled <= 0.7, shuffled
