"""Resource bounds of the writer: images too large to decode, and runs with too many bad inputs."""

from __future__ import annotations

import io
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata.cli import main
from fastdata.write import ShardOptions, TooManyBadSamplesError, write_shards
from fastdata.write import encode as encode_module
from fastdata.write.lock import LOCK_NAME
from fastdata.write.sources import FolderSource, ListSource

from .test_lock import _holder

imagecodecs = pytest.importorskip("imagecodecs", reason="writes the WebP/TIFF cases with it")

OPTS = ShardOptions(max_count=8, workers=1, progress=False, max_bad=0.5)


def _png(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (its pixel data is a 4x4 image's: never decoded)."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = bytearray(data[12:29])  # type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_a_huge_image_is_refused_from_its_header_without_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bomb = _png(10_000, 10_000)
    root = _folder(tmp_path / "ds", {"a/bomb.png": bomb, "a/ok.png": _png(4, 4)})
    decoded: list[int] = []
    real_open = encode_module.open_image

    def open_image(data: bytes) -> object:
        decoded.append(len(data))
        assert data != bomb, "the oversized image was decoded"
        return real_open(data)

    monkeypatch.setattr(encode_module, "open_image", open_image)
    manifest = write_shards(FolderSource(root), tmp_path / "out", OPTS)
    ((skipped,),) = [s.skipped for s in manifest.splits.values()]
    assert skipped.origin == str(root / "a" / "bomb.png")
    assert "10000 x 10000 = 100.0 megapixels" in skipped.reason
    assert "max_pixels=64,000,000" in skipped.reason and "not decoded" in skipped.reason
    assert decoded == [len(_png(4, 4))] and manifest.splits["train"].num_samples == 1


def test_the_pixel_bound_is_configurable_and_reads_webp_headers(tmp_path: Path) -> None:
    pixels = np.zeros((30, 40, 3), np.uint8)
    files = {
        "a/lossless.webp": imagecodecs.webp_encode(pixels, lossless=True),
        "a/lossy.webp": imagecodecs.webp_encode(pixels, lossless=False),
        "a/photo.png": _png(4, 4),
    }
    root = _folder(tmp_path / "ds", files)
    small = ShardOptions(**{**OPTS.__dict__, "max_pixels": 1000, "max_bad": 1.0})
    manifest = write_shards(FolderSource(root), tmp_path / "small", small)
    reasons = {Path(s.origin).name: s.reason for s in manifest.splits["train"].skipped}
    assert set(reasons) == {"lossless.webp", "lossy.webp"}
    assert all("40 x 30" in r for r in reasons.values())
    unbounded = ShardOptions(**{**OPTS.__dict__, "max_pixels": None})
    assert (
        write_shards(FolderSource(root), tmp_path / "all", unbounded).splits["train"].num_samples
        == 3
    )
    with pytest.raises(ValueError, match="max_pixels"):
        ShardOptions(max_pixels=0)


def _missing_list(tmp_path: Path, rows: int, present: int = 0) -> Path:
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "real.png")
    lines = ["real.png,0\n"] * present + [f"missing/{i}.png,{i % 3}\n" for i in range(rows)]
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\n" + "".join(lines))
    return lst


def test_a_list_of_missing_files_stops_with_exit_1_and_no_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst = _missing_list(tmp_path, 10_000)
    out = tmp_path / "out"
    args = ["shard", "list", str(lst), str(out), "--no-progress", "--workers", "2"]
    assert main(args) == 1
    err = capsys.readouterr().err
    # Stopped as soon as the run could not stay under 10%: at 1,001 bad, not 10,000.
    assert re.search(r"stopped: 1,00[0-9] of 10,000 inputs are bad, more than max_bad=0.1", err)
    assert err.count("cannot read file (No such file or directory)") == 10
    assert len(err) < 3000 and "Traceback" not in err
    assert not (out / "manifest.json").exists() and not (out / LOCK_NAME).exists()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]  # nothing half-written


def test_bad_inputs_under_max_bad_are_skipped_and_over_it_stop(tmp_path: Path) -> None:
    lst = _missing_list(tmp_path, 1, present=10)  # 1 bad of 11: 9%
    manifest = write_shards(ListSource(lst), tmp_path / "ok", ShardOptions(progress=False))
    assert manifest.splits["train"].num_samples == 10
    assert len(manifest.splits["train"].skipped) == 1
    with pytest.raises(TooManyBadSamplesError, match="1 of 11 inputs are bad") as info:
        write_shards(ListSource(lst), tmp_path / "strict", ShardOptions(max_bad=0, progress=False))
    assert "missing/0.png (list.csv:12): cannot read file" in str(info.value)
    assert not (tmp_path / "strict" / "manifest.json").exists()
    with pytest.raises(ValueError, match="max_bad"):
        ShardOptions(max_bad=1.5)


def test_a_second_shard_command_into_the_same_out_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst = _missing_list(tmp_path, 0, present=3)
    out = tmp_path / "out"
    with _holder(out) as proc:
        assert main(["shard", "list", str(lst), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(out / LOCK_NAME) in err and f"pid {proc.pid}" in err
    assert main(["shard", "list", str(lst), str(out), "--no-progress"]) == 0


def test_the_log_names_the_first_50_skips_and_the_manifest_keeps_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lst = _missing_list(tmp_path, 60, present=1)
    opts = ShardOptions(progress=False, workers=1, max_bad=1.0)
    with caplog.at_level("WARNING", logger="fastdata"):
        manifest = write_shards(ListSource(lst), tmp_path / "out", opts)
    assert len(manifest.splits["train"].skipped) == 60
    assert caplog.text.count("cannot read file") == 50
    assert "(+10 more: see the manifest's skipped lists)" in caplog.text


def test_the_shard_command_passes_its_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst = _missing_list(tmp_path, 2, present=2)  # labels 0, 0, 0, 1: two of four missing
    common = ["shard", "list", str(lst)]
    assert main([*common, str(tmp_path / "a"), "--no-progress"]) == 1  # 50% bad > 10%
    assert main([*common, str(tmp_path / "b"), "--no-progress", "--max-bad", "0.5"]) == 0
    assert main([*common, str(tmp_path / "c"), "--max-classes", "1"]) == 2
    assert "label '1' implies more than max_classes=1 classes" in capsys.readouterr().err
    code = main([*common, str(tmp_path / "d"), "--max-bad", "1", "--max-pixels", "15"])
    # (the summary that `fastdata shard` prints lists the skipped images with their reasons)
    assert (
        code == 0 and "4 x 4 = 0.0 megapixels, more than max_pixels=15" in capsys.readouterr().out
    )
