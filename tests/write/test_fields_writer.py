"""The writer with fields: same bytes for the same input, resume after a kill, --part/merge,
--max-side keeping masks and boxes on their pixels, verify decoding every field."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fastdata.format.manifest_io import load_manifest
from fastdata.read.verify import verify
from fastdata.write import ShardOptions, write_shards
from fastdata.write.parts import Part, merge_parts, write_part
from fastdata.write.sources import CocoSource, SegmentationSource
from tests.write.sources.family_data import (
    coloured,
    pixel_box,
    read_samples,
    write_coco,
    write_segmentation,
)

OPTS = ShardOptions(max_count=2, workers=1, progress=False)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _same_folders(a: Path, b: Path) -> None:
    assert _files(a) == _files(b)
    for name in _files(a):
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def _decoded(manifest, split: str = "train") -> dict[str, dict]:
    info = manifest.split(split)
    found: dict[str, dict] = {}
    for shard in info.shards:
        found.update(read_samples(Path(manifest.shard_url(shard)), info.field_specs))
    return found


def test_same_bytes_for_any_worker_count_and_part_split(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path / "seg", count=7)
    coco_images, ann = write_coco(tmp_path / "coco")
    for name, make in (
        ("seg", lambda: SegmentationSource(images, masks)),
        ("coco", lambda: CocoSource(coco_images, ann)),
    ):
        one = write_shards(make(), tmp_path / f"{name}1", OPTS)
        assert one.split("train").fields is not None
        write_shards(
            make(), tmp_path / f"{name}2", ShardOptions(max_count=2, workers=2, progress=False)
        )
        _same_folders(tmp_path / f"{name}1", tmp_path / f"{name}2")
        parted = tmp_path / f"{name}parts"
        for index in range(3):
            write_part(make(), parted, OPTS, Part(index, 3))
        merged = merge_parts(parted)
        assert merged.split("train").fields == one.split("train").fields
        _same_folders(tmp_path / f"{name}1", parted)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from fastdata.write.sources import SegmentationSource
    from fastdata.write import ShardOptions, write_shards

    class Slow:
        def __init__(self, inner):
            self.inner, self.kind, self.classes = inner, inner.kind, inner.classes
        def splits(self):
            return self.inner.splits()
        def sample_fields(self, split):
            return self.inner.sample_fields(split)
        def fingerprint(self):
            return self.inner.fingerprint()
        def item(self, split, index):
            time.sleep(0.05)
            return self.inner.item(split, index)

    source = Slow(SegmentationSource({images!r}, {masks!r}))
    write_shards(source, {out!r}, ShardOptions(max_count=2, workers=1, progress=False))
    """
)


def test_killed_run_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path / "seg", count=12)
    reference = tmp_path / "reference"
    write_shards(SegmentationSource(images, masks), reference, OPTS)
    out = tmp_path / "out"
    root = str(Path(__file__).parents[2])
    script = KILL_SCRIPT.format(root=root, images=str(images), masks=str(masks), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script])
    work = out / ".fastdata-work"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(work.glob("*.done.json"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = list(work.glob("*.done.json"))
    assert 2 <= len(finished) < 6, "the kill should land mid-run"
    assert not (out / "manifest.json").exists()
    write_shards(SegmentationSource(images, masks), out, OPTS)
    _same_folders(reference, out)


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_max_side_keeps_masks_and_boxes_on_their_pixels(tmp_path: Path, ext: str) -> None:
    images, masks = write_segmentation(tmp_path / "seg", count=4, ext=ext)
    options = ShardOptions(max_count=8, workers=1, progress=False, max_side=100)
    manifest = write_shards(SegmentationSource(images, masks), tmp_path / "seg_out", options)
    assert manifest.source["options"]["max_side"] == 100
    assert manifest.split("train").image_stats["max_width"] == 100  # 400 x 300 -> 100 x 75
    for key, sample in _decoded(manifest).items():
        rect = coloured(sample["image"])
        assert sample["image"].shape == (75, 100, 3) and rect.sum() > 100, key
        np.testing.assert_array_equal(sample["mask"][:74] > 0, rect[:74], err_msg=key)
        assert (sample["mask"][74:] == 255).all()  # the 4-px ignore border, 1 px after shrinking

    coco_images, ann = write_coco(tmp_path / "coco", ext=ext)
    manifest = write_shards(CocoSource(coco_images, ann), tmp_path / "coco_out", options)
    (big,) = [s for s in _decoded(manifest).values() if s["image"].shape[1] == 100]
    assert big["image"].shape == (75, 100, 3)  # 400 x 300 shrunk; the small ones kept as is
    np.testing.assert_allclose(big["boxes"][0][0], pixel_box(coloured(big["image"])), atol=1.0)
    np.testing.assert_array_equal(big["boxes"][0][0], [10, 20, 50, 60])
    small = [s for s in _decoded(manifest).values() if s["image"].shape[1] == 80]
    assert any(len(s["boxes"][0]) and (s["boxes"][0][0] == [8, 12, 40, 36]).all() for s in small)


def test_max_side_off_by_default_and_keeps_small_images_byte_identical(tmp_path: Path) -> None:
    images, ann = write_coco(tmp_path / "coco", ext=".jpg")
    plain = write_shards(CocoSource(images, ann), tmp_path / "plain", OPTS)
    assert "max_side" not in plain.source["options"]
    big = ShardOptions(max_count=2, workers=1, progress=False, max_side=4000)
    write_shards(CocoSource(images, ann), tmp_path / "big", big)
    jpgs = {p.read_bytes() for p in images.rglob("*.jpg")}
    assert {s["image"].tobytes() for s in _decoded(plain).values()}  # decodable
    for folder in ("plain", "big"):  # JPEG bytes kept when not shrunk
        data = b"".join(tar.read_bytes() for tar in (tmp_path / folder).glob("*.tar"))
        assert sum(j in data for j in jpgs) == 4, folder


def test_verify_decodes_every_field_and_names_the_one_that_fails(tmp_path: Path) -> None:
    images, masks = write_segmentation(tmp_path / "seg", count=3)
    out = tmp_path / "out"
    write_shards(SegmentationSource(images, masks), out, OPTS)
    report = verify(out, progress=False)
    assert report.ok and report.samples_checked == 3
    saved = json.loads((out / "manifest.json").read_text())
    saved["splits"]["train"]["fields"]["caption"] = {"kind": "text", "components": ["txt"]}
    (out / "manifest.json").write_text(json.dumps(saved))
    assert load_manifest(out).split("train").fields["caption"].kind == "text"
    report = verify(out, progress=False)
    assert len(report.bad_samples) == 3
    assert all(
        "train-00000" in bad and "train_0000000" in bad and "field 'caption'" in bad
        for bad in report.bad_samples
    )


def test_max_side_shrinks_array_sources_too(tmp_path: Path) -> None:
    from tests.conftest import unique_label_source

    options = ShardOptions(max_count=64, workers=1, progress=False, max_side=4)
    manifest = write_shards(unique_label_source(), tmp_path / "out", options)
    train = manifest.split("train")
    assert (train.encoding, train.raw_shape, train.fields) == ("raw", [4, 4, 3], None)
    assert verify(tmp_path / "out", progress=False).ok


def test_an_unreadable_mask_names_its_file_not_a_bytesio(tmp_path: Path) -> None:
    from fastdata.format.fields import FieldError, FieldSpec

    images, masks = write_segmentation(tmp_path / "seg", count=3)
    (masks / "a01.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)  # a signature, no PNG
    (masks / "a02.png").write_bytes(b"<html>not found</html>")
    skipped = dict(SegmentationSource(images, masks).skipped["train"])
    reasons = {origin.rsplit(" mask ", 1)[1]: reason for origin, reason in skipped.items()}
    assert "BytesIO" not in str(reasons)
    assert "a PNG file Pillow cannot identify" in reasons[str(masks / "a01.png")]
    assert "not an image: starts with '<html>" in reasons[str(masks / "a02.png")]
    with pytest.raises(FieldError) as info:  # the read side: the caller adds shard and key
        FieldSpec("mask", "mask", ("mask.png",)).decode({"mask.png": b"GIF8 broken"})
    assert "BytesIO" not in str(info.value) and "starts b'GIF8 bro'" in str(info.value)


def test_resize_on_a_source_with_masks_is_refused_naming_max_side(tmp_path: Path) -> None:
    # `resize` shrinks the image alone: before, every sample was then refused as bad ("the
    # mask is 400 x 300 (W x H) but the image is 100 x 75") and the run stopped.
    images, masks = write_segmentation(tmp_path / "seg", count=2)
    options = ShardOptions(max_count=8, workers=1, progress=False, resize=75)
    with pytest.raises(ValueError, match="use max_side=75"):
        write_shards(SegmentationSource(images, masks), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_resize_and_max_side_shrink_alike() -> None:
    from PIL import Image

    from fastdata.write.encode import shrink

    image = Image.new("RGB", (400, 300))
    assert shrink(image, 150).size == (200, 150)  # resize: the shorter side
    assert shrink(image, 100, longer=True).size == (100, 75)  # max_side: the longer side
    assert shrink(image, 300) is image and shrink(image, 400, longer=True) is image
