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


def test_a_box_with_no_width_in_float32_is_dropped_and_not_counted(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    data = json.loads(ann.read_text())
    # 1e-6 px wide at x=100: positive in float64, 0 px in float32 (100.000001 -> 100.0).
    tiny = {"id": 6, "image_id": 9, "category_id": 4, "bbox": [100, 100, 1e-6, 5], "iscrowd": 0}
    data["annotations"].append(tiny)
    ann.write_text(json.dumps(data))
    source = CocoSource(images, ann)
    assert source.stats["boxes"] == 3 and source.stats["degenerate_dropped"] == 2
    by_id = {source.item("train", i).origin.split("image id ")[1][:-1]: i for i in range(4)}
    boxes, labels = source.item("train", by_id["9"]).fields["boxes"]
    np.testing.assert_array_equal(boxes, [[40, 80, 200, 240]])
    assert boxes.dtype == np.float32 and labels.tolist() == [1]


def test_the_writer_keeps_only_boxes_with_size_in_float32(tmp_path: Path) -> None:
    from fastdata.format.fields import FieldSpec
    from fastdata.write.sources.base import SourceItem

    class Boxes:  # any source with a boxes field: the writer drops what float32 makes empty
        kind, classes = "boxes", ["a", "b"]

        def splits(self) -> dict[str, int]:
            return {"train": 2}

        def sample_fields(self, split: str) -> dict[str, FieldSpec]:
            return {"boxes": FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy"))}

        def item(self, split: str, index: int) -> SourceItem:
            boxes = np.array([[2, 1, 2.0000001, 5], [1, 1, 4, 4], [3, 3, 6, 3.00000001]])
            return SourceItem(
                index,
                -1,
                f"mem[{index}]",
                pixels=np.full((8, 8, 3), 40 * index, dtype=np.uint8),
                fields={"boxes": (boxes, np.array([0, 1, 0]))},
            )

        def fingerprint(self) -> dict:
            return {"kind": self.kind}

    options = ShardOptions(max_count=3, workers=1, progress=False, encoding="png")
    manifest = write_shards(Boxes(), tmp_path / "out", options)
    split = manifest.split("train")
    found = {}
    for shard in split.shards:
        found.update(read_samples(Path(manifest.shard_url(shard)), split.field_specs))
    for value in found.values():
        np.testing.assert_array_equal(value["boxes"][0], [[1, 1, 4, 4]])
        assert value["boxes"][1].tolist() == [1]
    assert split.class_counts == [0, 2]  # class 0's boxes had no size: no sample holds it


def test_a_duplicate_annotation_id_is_refused_naming_it(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path)
    data = json.loads(ann.read_text())
    data["annotations"] += [dict(data["annotations"][2]), dict(data["annotations"][0])]
    ann.write_text(json.dumps(data))
    with pytest.raises(BadSourceError) as info:
        CocoSource(images, ann)
    assert str(ann) in str(info.value)
    assert "annotation id 3 is listed twice (annotations[2] and annotations[5])" in str(info.value)


def test_max_json_bytes_is_a_cli_flag_the_error_names(tmp_path: Path, capsys) -> None:
    from fastdata.cli import main

    images, ann = write_coco(tmp_path)
    args = ["shard", "coco", str(images), str(ann), str(tmp_path / "out"), "--no-progress"]
    capsys.readouterr()
    assert main([*args, "--max-json-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "more than max_json_bytes=100" in err and "--max-json-bytes" in err
    assert main([*args, "--max-json-bytes", "1M", "--workers", "1"]) == 0
    assert (
        main(["shard", "folder", str(images), str(tmp_path / "f"), "--max-json-bytes", "1M"]) == 2
    )
    assert "--max-json-bytes is for the coco source" in capsys.readouterr().err


def test_streamed_in_tiny_chunks_the_json_reads_the_same(tmp_path: Path, monkeypatch) -> None:
    from fastdata.write.sources import coco_json

    images, ann = write_coco(tmp_path)
    data = json.loads(ann.read_text())
    data = {
        "info": {"description": "caf\u00e9 \u2014 \\u00e9", "n": [1e2, -0.5, True, None]},
        **data,
    }
    data["images"][0]["file_name"] = "sub/007.png"  # kept; the info's escapes cross chunks
    ann.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    whole = CocoSource(images, ann)
    monkeypatch.setattr(coco_json, "_CHUNK", 3)  # every token and escape crosses a chunk's end
    cut = CocoSource(images, ann)
    assert (cut.stats, cut.classes, cut._records) == (whole.stats, whole.classes, whole._records)
    for i in range(4):
        for name in ("boxes", "crowd"):
            pairs = zip(
                cut.item("train", i).fields[name], whole.item("train", i).fields[name], strict=True
            )
            for a, b in pairs:  # (boxes, labels)
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"images": [], "categories": [', "not valid JSON"),  # cut short
        ('{"images": [], "categories": []} trailing', "text after the top-level object"),
        ('{"images": [], "images": [], "categories": []}', "'images' appears twice"),
        ('{"images": {}, "categories": []}', "'images' must be a list"),
        ('{"categories": []}', "'images' must be a list"),
        ('{"categories": [{"id": 1, "name": "a"} {"id": 2}], "images": []}', "expected ','"),
        ('{"images": [], "categories": [{"id": 1, "name": "a"}],}', "not valid JSON"),
        ("[]", "one JSON object"),
        (b'{"images": ["\xff"], "categories": []}', "not UTF-8"),
    ],
)
def test_malformed_json_is_an_error_naming_the_file(tmp_path: Path, text, problem: str) -> None:
    images, ann = write_coco(tmp_path)
    if isinstance(text, bytes):
        ann.write_bytes(text)
    else:
        ann.write_text(text)
    with pytest.raises(BadSourceError, match=problem) as info:
        CocoSource(images, ann)
    assert str(ann) in str(info.value)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_opening_a_large_json_takes_less_memory_than_its_size(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.write.sources.family_data import write_large_coco

    ann = write_large_coco(tmp_path / "big.json", images=4000)
    size = ann.stat().st_size
    assert size > 12 << 20
    (tmp_path / "images").mkdir()
    # VmHWM: this process's own peak RSS (ru_maxrss would carry the forking pytest's over exec).
    probe = (
        "import sys\n"
        "from fastdata.write.sources.coco import CocoSource\n"
        "def peak():\n"
        "    status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        "    return int(status.split()[0]) * 1024\n"
        "before = peak()\n"
        "source = CocoSource(sys.argv[1], sys.argv[2])\n"
        "print(peak() - before, source.stats['boxes'] + source.stats['degenerate_dropped'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "images"), str(ann)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    grown, annotations = int(out[0]), int(out[1])
    assert annotations == 4000 * 7
    print(f"{size / 2**20:.1f} MiB json: peak RSS grew {grown / 2**20:.1f} MiB")
    assert grown < size  # json.loads and dicts per annotation: ~7x the size
