"""The field registry (`fastdata.format.fields`): every kind round-trips, bad components are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastdata.format.field_inference import infer_fields
from fastdata.format.fields import (
    FIELD_KINDS,
    FieldError,
    FieldSpec,
    fields_from_json,
    fields_to_json,
    is_classification,
)
from fastdata.format.manifest_io import manifest_from_dict

VALUES = {
    "label": 7,
    "labels": [0, 4, 9],
    "mask": np.arange(24, dtype=np.uint8).reshape(4, 6),
    "text": "caption with ünïcode",
    "array": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
    "json": {"a": [1, 2], "b": "x"},
}


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_every_kind_round_trips(kind):
    spec = FieldSpec(kind, kind, FIELD_KINDS[kind].components)
    back = spec.decode(spec.encode(VALUES[kind]))
    np.testing.assert_equal(np.asarray(back), np.asarray(VALUES[kind]))


def test_sixteen_bit_masks_and_boxes_round_trip():
    spec = FieldSpec("mask", "mask", ("mask.png",))
    mask = np.array([[0, 300], [65535, 1]], dtype=np.uint16)
    assert (spec.decode(spec.encode(mask)) == mask).all()
    boxes = FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy"))
    xyxy, cls = boxes.decode(boxes.encode(([[1, 2, 5, 6], [0, 0, 1, 1]], [3, 4])))
    assert xyxy.dtype == np.float32 and xyxy.tolist() == [[1, 2, 5, 6], [0, 0, 1, 1]]
    assert cls.tolist() == [3, 4]


@pytest.mark.parametrize(
    "kind, parts",
    [
        ("labels", {"labels.npy": b"not npy"}),
        ("mask", {"mask.png": b"\x89PNG broken"}),
        ("text", {"txt": b"\xff\xfe"}),
        ("json", {"json": b"{"}),
        ("boxes", {"boxes.npy": b"x", "box_labels.npy": b"y"}),
        ("label", {"cls": b"seven"}),
    ],
)
def test_broken_components_raise_field_error(kind, parts):
    with pytest.raises(FieldError):
        FieldSpec(kind, kind, FIELD_KINDS[kind].components).decode(parts)


def test_a_pickled_array_is_refused():
    import io

    out = io.BytesIO()
    np.save(out, np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(FieldError, match="(?i)pickle|objects"):
        FieldSpec("array", "array", ("npy",)).decode({"npy": out.getvalue()})


def test_inverted_boxes_are_refused():
    spec = FieldSpec("boxes", "boxes", ("boxes.npy", "box_labels.npy"))
    with pytest.raises(FieldError, match="x1 >= x0"):
        spec.decode(spec.encode(([[5, 5, 1, 1]], [0])))


def test_infer_and_classification():
    assert is_classification(infer_fields(["jpg", "cls"]))
    found = infer_fields(["jpg", "json", "txt", "mask.png", "boxes.npy", "box_labels.npy"])
    assert {n: f.kind for n, f in found.items()} == {
        "image": "image",
        "json": "json",
        "text": "text",
        "mask": "mask",
        "boxes": "boxes",
    }
    assert not is_classification(found)


def test_manifest_fields_round_trip_and_are_checked(tmp_path):
    fields = infer_fields(["png", "mask.png"])
    data = fields_to_json(fields)
    assert fields_from_json(data, "x") == fields
    with pytest.raises(FieldError, match="placed on an image"):
        fields_from_json({"mask": data["mask"]}, "x")
    with pytest.raises(FieldError, match="at most one image"):
        fields_from_json({**data, "photo": {"kind": "image", "components": ["jpg"]}}, "x")
    with pytest.raises(FieldError, match="belongs to fields"):
        fields_from_json({**data, "other": {"kind": "mask", "components": ["mask.png"]}}, "x")
    with pytest.raises(FieldError, match="unknown kind"):
        fields_from_json({**data, "z": {"kind": "video", "components": ["mp4"]}}, "x")


def test_old_manifest_loads_as_image_and_label(tiny_shards):
    manifest = manifest_from_dict(
        json.loads((tiny_shards / "manifest.json").read_text()), str(tiny_shards)
    )
    split = next(iter(manifest.splits.values()))
    assert split.fields is None
    assert is_classification(split.field_specs)
    assert "fields" not in (tiny_shards / "manifest.json").read_text()


def test_an_npy_header_claiming_more_than_it_holds_is_refused_before_allocating():
    import io

    out = io.BytesIO()
    header = {"descr": "<i8", "fortran_order": False, "shape": (2**40,)}  # 8 TiB claimed
    np.lib.format.write_array_header_1_0(out, header)
    out.write(b"\0" * 64)
    with pytest.raises(FieldError, match="header says"):
        FieldSpec("array", "array", ("npy",)).decode({"npy": out.getvalue()})


def test_a_mask_png_claiming_a_huge_size_is_refused_from_its_header():
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)  # 900 Mpx, 8-bit grey
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    with pytest.raises(FieldError, match="more than|decompression bomb"):
        FieldSpec("mask", "mask", ("mask.png",)).decode({"mask.png": png})


def test_the_image_field_must_be_named_image():
    with pytest.raises(FieldError, match="named 'image'"):
        fields_from_json({"img": {"kind": "image", "components": ["jpg"]}}, "x")
    with pytest.raises(FieldError, match="padded"):
        fields_from_json(
            {
                "image": {"kind": "image", "components": ["jpg"]},
                "padded": {"kind": "text", "components": ["txt"]},
            },
            "x",
        )


@pytest.mark.parametrize(
    ("mode", "accepted"),
    [("L", True), ("P", True), ("I;16", True), ("1", False), ("LA", False), ("RGB", False)],
)
def test_the_writer_and_the_readers_accept_the_same_mask_pngs(tmp_path, mode, accepted):
    import io

    from PIL import Image

    from fastdata.write.encode import BadSampleError
    from fastdata.write.sample_fields import read_mask
    from fastdata.write.sources.base import MaskFile

    values = np.array([[0, 1], [1, 0]], dtype=np.uint8)
    image = Image.fromarray(values * (255 if mode == "1" else 1), "L").convert(mode)
    out = io.BytesIO()
    image.save(out, "PNG")
    path = tmp_path / "m.png"
    path.write_bytes(out.getvalue())
    spec = FieldSpec("mask", "mask", ("mask.png",))
    if accepted:
        read = spec.decode({"mask.png": out.getvalue()})
        written = read_mask(MaskFile(path), None, "a.jpg")
        np.testing.assert_array_equal(read, values)
        np.testing.assert_array_equal(written, values)
        return
    with pytest.raises(FieldError, match=f"mode {mode} is not a single-channel class map"):
        spec.decode({"mask.png": out.getvalue()})
    with pytest.raises(BadSampleError, match=f"mode {mode} is not a single-channel class map"):
        read_mask(MaskFile(path), None, "a.jpg")
