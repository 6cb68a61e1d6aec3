"""The raw block path (`fastdata.write.rawblock`): a source that hands over a shard's pixels as
one array gets the same bytes as the per-sample path, for any image size, label width and
number of writer processes; its pixel statistics equal the per-image ones."""

from __future__ import annotations

import filecmp
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdata.write import ShardOptions, rawblock, write_shards
from fastdata.write.sources.arrays import ArraySource
from fastdata.write.sources.base import PixelBlock, SourceItem
from fastdata.write.stats import PixelStats


class PerSample:
    """A source as the writer saw every source before: `item` only, no `pixel_block`."""

    def __init__(self, source: Any) -> None:
        self.kind, self.classes, self._source = source.kind, source.classes, source
        self.items = 0

    def splits(self) -> dict[str, int]:
        return self._source.splits()

    def item(self, split: str, index: int) -> SourceItem:
        self.items += 1
        return self._source.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        return self._source.fingerprint()


class Blocks(PerSample):
    """The same source with `pixel_block`, stacked from its items (no channel planes)."""

    def pixel_block(self, split: str, indices: Sequence[int]) -> PixelBlock:
        items = [self._source.item(split, i) for i in indices]
        return PixelBlock(
            np.stack([it.pixels for it in items]),
            np.array([it.label for it in items], dtype=np.int64),
            np.array([it.sample_id for it in items], dtype=np.int64),
        )


def _arrays(height: int, width: int, classes: int) -> ArraySource:
    rng = np.random.default_rng(1)
    splits = {
        name: (
            rng.integers(0, 256, (n, height, width, 3), dtype=np.uint8),
            rng.integers(0, classes, n),
        )
        for name, n in (("train", 150), ("test", 37))
    }
    return ArraySource(splits, [f"c{i}" for i in range(classes)])


def assert_same_folders(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert any(n.endswith(".tar") for n in names) and "manifest.json" in names
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), f"{name} differs"


@pytest.mark.parametrize(
    ("height", "width", "classes", "workers", "chunk"),
    # labels of 1-3 digits; image data not whole blocks; chunks that do not divide a shard
    [(5, 7, 1000, 1, 1024), (8, 8, 7, 2, 1024), (1, 171, 12, 1, 7), (8, 8, 300, 2, 10)],
)
def test_block_path_writes_the_per_sample_bytes(
    tmp_path: Path,
    height: int,
    width: int,
    classes: int,
    workers: int,
    chunk: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rawblock, "CHUNK", chunk)
    arrays = _arrays(height, width, classes)
    options = ShardOptions(max_count=64, workers=workers, progress=False)
    write_shards(PerSample(arrays), tmp_path / "per-sample", options)
    blocks = Blocks(arrays)
    write_shards(blocks, tmp_path / "blocks", options)
    # The block path was taken: only the writer's identity probe asked for one item
    # (a stacked block reads items through `_source`, not through the counting `item`).
    assert blocks.items == 1
    assert_same_folders(tmp_path / "per-sample", tmp_path / "blocks")


def test_chunks_without_a_common_layout_are_written_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk the block layout refuses goes through `ShardTarWriter.write`, between chunks
    that do not: the tar, its index, digests and sha256 are still the per-sample path's."""
    arrays = _arrays(6, 6, 50)
    options = ShardOptions(max_count=64, workers=1, progress=False)
    write_shards(PerSample(arrays), tmp_path / "per-sample", options)
    lay_out, calls = rawblock._lay_out, []

    def every_other(*args: Any) -> Any:
        calls.append(1)
        return None if len(calls) % 2 else lay_out(*args)

    monkeypatch.setattr(rawblock, "CHUNK", 9)
    monkeypatch.setattr(rawblock, "_lay_out", every_other)
    blocks = Blocks(arrays)
    write_shards(blocks, tmp_path / "blocks", options)
    assert blocks.items == 1 and len(calls) > 4
    assert_same_folders(tmp_path / "per-sample", tmp_path / "blocks")


class Crashing(PerSample):
    """Fails on the `crash_at`-th item: a run that stops part-way, leaving finished shards."""

    def __init__(self, source: Any, crash_at: int) -> None:
        super().__init__(source)
        self.crash_at = crash_at

    def item(self, split: str, index: int) -> SourceItem:
        if self.items + 1 == self.crash_at:
            raise RuntimeError("killed")
        return super().item(split, index)


def test_block_path_resumes_into_the_same_bytes(tmp_path: Path) -> None:
    """A run stopped after some shards: the block path finishes the folder as one run would."""
    arrays = _arrays(8, 8, 100)
    options = ShardOptions(max_count=40, workers=1, progress=False)
    write_shards(PerSample(arrays), tmp_path / "ref", options)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):  # test (37) and 1.5 train shards written
        write_shards(Crashing(arrays, crash_at=1 + 37 + 60), out, options)
    assert (out / "train-000000.tar").exists() and not (out / "train-000001.tar").exists()
    blocks = Blocks(arrays)
    write_shards(blocks, out, options)
    assert blocks.items == 1
    assert_same_folders(tmp_path / "ref", out)


@pytest.mark.parametrize(("side", "channels_first"), [(6, False), (6, True), (16, True)])
def test_block_statistics_equal_per_image_ones(side: int, channels_first: bool) -> None:
    """16 x 16 planes take the float32 runs; the sums must still be exact (255s included)."""
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (1100, side, side + 1, 3), dtype=np.uint8)
    if side == 16:
        pixels = pixels[:, :, :16]  # 256 pixels: whole runs
    pixels = np.ascontiguousarray(pixels)
    pixels[:7] = 255  # the largest values, where a float32 sum would round
    height, width = pixels.shape[1:3]
    one_by_one = PixelStats()
    for image in pixels:
        one_by_one.add("rgb", image.tobytes(), height, width)
    block = PixelStats()
    flat = pixels.reshape(len(pixels), height * width, 3)
    planes = np.ascontiguousarray(flat.transpose(0, 2, 1)) if channels_first else None
    block.add_block(pixels, planes)
    assert block.to_list() == one_by_one.to_list()
