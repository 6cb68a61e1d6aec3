"""Segmentation source: images and PNG masks paired by stem; sizes checked; unpaired files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, SegmentationSource
from tests.write.sources.family_data import coloured, read_samples, write_segmentation

OPTS = ShardOptions(max_count=4, workers=1, progress=False)


def test_pairs_round_trip_with_palette_and_16_bit_masks(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path, count=5)
    big = np.zeros((300, 400), dtype=np.uint16)
    big[80:240, 56:200] = 1000  # a 16-bit mask of image a04 (its rectangle): class 1000
    Image.fromarray(big).save(masks / "a04.png")
    source = SegmentationSource(images, masks)
    assert source.splits() == {"train": 5}
    assert source.classes == [str(i) for i in range(1001)]  # 0..max; 255 is the ignore index
    manifest = write_shards(source, tmp_path / "out", OPTS)
    split = manifest.split("train")
    assert {n: f.kind for n, f in split.fields.items()} == {"image": "image", "mask": "mask"}
    found = {}
    for shard in split.shards:
        found.update(read_samples(Path(manifest.shard_url(shard)), split.field_specs))
    assert sorted(found) == [f"train_{i:08d}" for i in range(5)]
    for i in range(5):
        sample = found[f"train_{i:08d}"]
        mask, rect = sample["mask"], coloured(sample["image"])
        value = 1000 if i == 4 else i % 3 + 1  # palette masks (odd i) are read as indices
        assert mask.dtype == (np.uint16 if i == 4 else np.uint8)
        np.testing.assert_array_equal(mask[:296] == value, rect[:296])
        assert (mask[296:] == (0 if i == 4 else 255)).all()
    assert split.class_counts[1] == 2 and split.class_counts[1000] == 1


def test_size_mismatch_names_both_files(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path, count=3)
    Image.fromarray(np.zeros((30, 40), dtype=np.uint8)).save(masks / "a01.png")
    options = ShardOptions(max_count=4, workers=1, progress=False, max_bad=1.0)
    manifest = write_shards(SegmentationSource(images, masks), tmp_path / "out", options)
    (skipped,) = manifest.split("train").skipped
    assert str(images / "a01.png") in skipped.origin and str(masks / "a01.png") in skipped.origin
    assert "the mask is 40 x 30 (W x H) but the image is 400 x 300" in skipped.reason
    assert manifest.split("train").num_samples == 2


def test_unpaired_files_are_listed_as_skipped(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path, count=3)
    (masks / "a02.png").rename(masks / "orphan.png")
    source = SegmentationSource(images, masks)
    assert source.splits() == {"train": 2}
    reasons = dict(source.skipped["train"])
    assert "image without a mask" in reasons[str(images / "a02.png")]
    assert "mask without an image" in reasons[str(masks / "orphan.png")]
    options = ShardOptions(max_count=4, workers=1, progress=False, max_bad=1.0)
    manifest = write_shards(source, tmp_path / "out", options)
    assert sorted(s.origin for s in manifest.split("train").skipped) == sorted(reasons)
    with pytest.raises(Exception, match="2 of 4 inputs are bad"):  # counted towards --max-bad
        write_shards(source, tmp_path / "strict", OPTS)


def test_split_folders_classes_and_values_outside_them(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path, count=3, splits=("train", "val"))
    source = SegmentationSource(images, masks, classes=["bg", "a", "b", "c"])
    assert source.splits() == {"train": 3, "val": 3} and source.classes[3] == "c"
    options = ShardOptions(max_count=4, workers=1, progress=False, max_bad=1.0)
    narrow = SegmentationSource(images, masks, classes=["bg", "a"])  # values 2 and 3 are not
    manifest = write_shards(narrow, tmp_path / "out", options)
    reasons = [s.reason for s in manifest.split("val").skipped]
    assert reasons and all("is not one of the 2 classes" in r for r in reasons)
    (masks / "val").rename(tmp_path / "elsewhere")
    with pytest.raises(BadSourceError, match="lacks \\['val'\\]"):
        SegmentationSource(images, masks)


@pytest.mark.parametrize("unpaired", ["image", "mask"])
def test_strict_stops_on_an_unpaired_file_naming_it(tmp_path: Path, capsys, unpaired: str) -> None:
    from fastdata.cli import main

    images, masks = write_segmentation(tmp_path, count=3)
    if unpaired == "image":
        (masks / "a02.png").unlink()
        named, reason = images / "a02.png", "image without a mask"
    else:
        (images / "a02.png").unlink()
        named, reason = masks / "a02.png", "mask without an image"
    out = tmp_path / "out"
    args = ["shard", "segmentation", str(images), str(masks), str(out), "--no-progress"]
    capsys.readouterr()
    assert main([*args, "--strict", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "strict mode" in err and f"{named}: {reason}" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tar"))
    assert main([*args, "--max-bad", "0.5", "--workers", "1"]) == 0  # without --strict: skipped
