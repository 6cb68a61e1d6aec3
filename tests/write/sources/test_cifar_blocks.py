"""CifarSource's `pixel_block` (the shard writer's fast path) on fake archives: the same samples
as `item`, the same shard bytes as the per-sample path, and a `fastdata shard` that starts
without torch."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import CifarSource
from fastdata.write.sources.base import SourceItem

FakeBuilder = Callable[..., Any]
REPO = Path(__file__).resolve().parents[3]


class PerSample:
    """The CIFAR source without `pixel_block`: what the writer did before the fast path."""

    def __init__(self, source: CifarSource) -> None:
        self.kind, self.classes, self._source = source.kind, source.classes, source

    def splits(self) -> dict[str, int]:
        return self._source.splits()

    def item(self, split: str, index: int) -> SourceItem:
        return self._source.item(split, index)

    def fingerprint(self) -> dict[str, Any]:
        return self._source.fingerprint()


@pytest.mark.parametrize("native", [True, False], ids=["C", "numpy"])
@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_pixel_block_equals_items(
    tmp_path: Path,
    fake_cifar: FakeBuilder,
    kind: str,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fastdata._util import native as _native

    if native and _native.pixels is None:
        pytest.skip("fastdata._pixels was not built")
    if not native:
        monkeypatch.setattr(_native, "pixels", None)
    source = CifarSource(fake_cifar(tmp_path, kind, n_train=23, n_test=9).path, kind=kind)
    ids = [22, 0, 5, 13, 5, 7]  # across cifar10's five batch files, one twice
    block = source.pixel_block("train", ids)
    assert block.pixels.shape == (6, 32, 32, 3) and block.pixels.flags["C_CONTIGUOUS"]
    for row, i in enumerate(ids):
        item = source.item("train", i)
        np.testing.assert_array_equal(block.pixels[row], item.pixels)
        assert (block.labels[row], block.sample_ids[row]) == (item.label, item.sample_id)
        if block.planes is not None:
            planes = block.planes[row].reshape(3, 32, 32).transpose(1, 2, 0)
            np.testing.assert_array_equal(planes, item.pixels)
    # The C path counts the moments while it gathers: exactly numpy's sums.
    assert (block.moments is not None) == native
    if block.moments is not None:
        flat = block.pixels.reshape(-1, 3).astype(np.uint64)
        expected = np.concatenate([flat.sum(axis=0), (flat * flat).sum(axis=0)])
        np.testing.assert_array_equal(block.moments, expected)
    with pytest.raises(IndexError, match=r"train\[23\] is out of range"):
        source.pixel_block("train", [1, 23])
    with pytest.raises(ValueError, match="unknown split"):
        source.pixel_block("val", [0])


@pytest.mark.parametrize(("kind", "workers"), [("cifar10", 1), ("cifar100", 2)])
def test_fast_shards_are_the_per_sample_bytes(
    tmp_path: Path,
    fake_cifar: FakeBuilder,
    kind: str,
    workers: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = CifarSource(fake_cifar(tmp_path / "in", kind, n_train=45, n_test=12).path, kind=kind)
    options = ShardOptions(max_count=16, workers=workers, progress=False)
    write_shards(PerSample(source), tmp_path / "per-sample", options)
    probes = []

    def first_item_only(split: str, index: int) -> SourceItem:
        """The writer's identity probe may read one item; shards must come from blocks."""
        assert not probes, "the writer read items one by one: the block path was not taken"
        probes.append(index)
        return CifarSource.item(source, split, index)

    monkeypatch.setattr(source, "item", first_item_only)
    write_shards(source, tmp_path / "fast", options)
    names = sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "per-sample").iterdir())
    assert len([n for n in names if n.endswith(".tar")]) == 4  # 16 + 16 + 13 train, 12 test
    for name in names:
        assert filecmp.cmp(tmp_path / "fast" / name, tmp_path / "per-sample" / name, shallow=False)


def test_shard_command_starts_without_torch(tmp_path: Path, fake_cifar: FakeBuilder) -> None:
    """`fastdata shard` imports neither torch nor Lightning (seconds of start-up it never used)."""
    archive = fake_cifar(tmp_path, "cifar100", n_train=12, n_test=4).path
    script = textwrap.dedent(
        f"""
        import sys
        from fastdata.cli import main
        code = main(["shard", "cifar100", {str(archive)!r}, {str(tmp_path / "out")!r},
                     "--no-progress", "--workers", "1"])
        heavy = sorted(m for m in ("torch", "lightning") if m in sys.modules)
        print("heavy:", heavy)
        sys.exit(code or (3 if heavy else 0))
        """
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "heavy: []" in done.stdout
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_planes_to_pixels_checks_its_buffers() -> None:
    from fastdata._util import native as _native

    if _native.pixels is None:
        pytest.skip("fastdata._pixels was not built")
    gather = _native.pixels.planes_to_pixels
    src = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ids = np.array([1, 0], dtype=np.int64)
    out = np.empty((2, 4, 3), dtype=np.uint8)
    moments = np.zeros(6, dtype=np.uint64)
    gather(src, ids, out, 4, moments)
    np.testing.assert_array_equal(out, src[ids].transpose(0, 2, 1))
    with pytest.raises(IndexError, match="id 2 is out of range"):
        gather(src, np.array([0, 2], dtype=np.int64), out, 4, moments)
    for plane in (0, 5, 2**62):  # not a whole sample, and one whose size overflows
        with pytest.raises(ValueError, match="whole 3 x plane samples"):
            gather(src, ids, out, plane, moments)
    with pytest.raises(ValueError):
        gather(src, ids, np.empty((3, 4, 3), dtype=np.uint8), 4, moments)  # one row per id
    with pytest.raises(ValueError):
        gather(src, ids, out, 4, np.zeros(5, dtype=np.uint64))
