"""COCO detection source: boxes, crowd regions, empty images, clipping, untrusted json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources import BadSourceError, CocoSource
from tests.write.sources.family_data import read_samples, write_coco

OPTS = ShardOptions(max_count=3, workers=1, progress=False)


def test_boxes_crowd_empty_image_and_clipping(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    source = CocoSource(images, ann, split="val")
    assert source.classes == ["cat", "dog"]  # category ids 4, 20: sorted by id
    assert source.splits() == {"val": 4}  # the image without annotations is kept
    by_id = {source.item("val", i).origin.split("image id ")[1][:-1]: i for i in range(4)}
    crowded = source.item("val", by_id["3"]).fields
    np.testing.assert_array_equal(crowded["boxes"][0], [[8, 12, 40, 36]])
    np.testing.assert_array_equal(crowded["boxes"][1], [0])  # cat
    np.testing.assert_array_equal(crowded["crowd"][0], [[0, 0, 10, 10]])  # not a training box
    np.testing.assert_array_equal(crowded["crowd"][1], [1])  # dog
    empty = source.item("val", by_id["5"]).fields
    assert empty["boxes"][0].shape == (0, 4) and empty["crowd"][0].shape == (0, 4)
    clipped = source.item("val", by_id["7"]).fields
    np.testing.assert_array_equal(clipped["boxes"][0], [[60, 40, 80, 60]])  # the other dropped
    assert source.stats == {
        "boxes": 3,
        "crowd": 1,
        "clipped": 1,
        "degenerate_dropped": 1,
        "images_without_boxes": 1,
    }

    manifest = write_shards(source, tmp_path / "out", OPTS)
    split = manifest.split("val")
    assert {n: f.kind for n, f in split.fields.items()} == {
        "image": "image",
        "boxes": "boxes",
        "crowd": "boxes",
    }
    assert split.num_samples == 4 and not split.skipped
    assert manifest.source["fingerprint"]["stats"]["degenerate_dropped"] == 1
    assert split.class_counts == [1, 3]  # samples holding a cat / a dog (crowd regions too)
    found = {}
    for shard in split.shards:
        found.update(read_samples(Path(manifest.shard_url(shard)), split.field_specs))
    assert len(found) == 4
    boxes = sorted(tuple(map(tuple, v["boxes"][0].tolist())) for v in found.values())
    assert boxes == [(), ((8, 12, 40, 36),), ((40, 80, 200, 240),), ((60, 40, 80, 60),)]
    assert sum(len(v["crowd"][0]) for v in found.values()) == 1
    reloaded = load_manifest(tmp_path / "out")  # the fields survive the manifest's checks
    assert reloaded.split("val").fields == split.fields


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (
            {"annotations": [{"id": 7, "image_id": 3, "category_id": 99, "bbox": [0, 0, 1, 1]}]},
            r"annotation id 7 .*category id 99, not in 'categories'",
        ),
        (
            {"annotations": [{"id": 8, "image_id": 404, "category_id": 4, "bbox": [0, 0, 1, 1]}]},
            r"annotation id 8 .*image id 404, not in 'images'",
        ),
        (
            {"annotations": [{"id": 9, "image_id": 3, "category_id": 4, "bbox": [0, 0, 1]}]},
            r"annotation id 9 .*'bbox' must be 4 finite numbers",
        ),
        (
            {"images": [{"id": 1, "file_name": "../../etc/passwd", "width": 5, "height": 5}]},
            r"image id 1: file_name '../../etc/passwd' must be a relative path",
        ),
        ({"categories": []}, "lists no categories"),
    ],
)
def test_bad_annotations_are_named(tmp_path: Path, extra: dict, problem: str) -> None:
    images, ann = write_coco(tmp_path, extra)
    with pytest.raises(BadSourceError, match=problem) as info:
        CocoSource(images, ann)
    assert str(ann) in str(info.value)


def test_json_size_and_entries_are_bounded(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    with pytest.raises(BadSourceError, match="more than max_json_bytes=100"):
        CocoSource(images, ann, max_json_bytes=100)
    with pytest.raises(BadSourceError, match="more than max_entries=5"):
        CocoSource(images, ann, max_entries=5)
    ann.write_text("[" * 100_000)
    with pytest.raises(BadSourceError, match="not valid JSON"):
        CocoSource(images, ann)


def test_missing_and_resized_images_are_skipped_by_name(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    missing = images / "sub" / "005.png"
    missing.unlink()
    wrong = images / "sub" / "003.png"
    wrong.write_bytes((images / "sub" / "009.png").read_bytes())  # 400 x 300, json says 80 x 60
    options = ShardOptions(max_count=3, workers=1, progress=False, max_bad=1.0)
    manifest = write_shards(CocoSource(images, ann), tmp_path / "out", options)
    skipped = {s.origin: s.reason for s in manifest.split("train").skipped}
    assert manifest.split("train").num_samples == 2
    assert any(str(missing) in origin and "cannot read" in r for origin, r in skipped.items())
    assert any(
        str(wrong) in origin and "400 x 300 (W x H) but the annotations say 80 x 60" in r
        for origin, r in skipped.items()
    )


def test_json_file_is_what_is_read(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    data = json.loads(ann.read_text())
    data["annotations"] = []
    ann.write_text(json.dumps(data))
    source = CocoSource(images, ann)
    assert source.stats["images_without_boxes"] == 4  # COCO keeps images without boxes
