"""Fixtures for `fastdata index`: WebDataset shards written by webdataset's own ShardWriter."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

wds = pytest.importorskip("webdataset", reason="the index tests read shards webdataset writes")

N_TRAIN, N_TEST, PER_SHARD = 20, 9, 7


def colour(i: int) -> tuple[int, int, int]:
    """The solid colour of sample i's image (distinct per sample, far apart per channel)."""
    return (i * 37 + 20) % 256, (i * 91 + 50) % 256, (i * 53 + 90) % 256


def solid_jpeg(i: int, size: tuple[int, int] = (24, 20)) -> bytes:
    pixels = np.empty((size[1], size[0], 3), dtype=np.uint8)
    pixels[:] = colour(i)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=95)
    return out.getvalue()


def sha256s(folder: Path) -> dict[str, str]:
    """name -> sha256 of every tar under `folder`."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.tar"))
    }


@pytest.fixture
def cls_shards(tmp_path: Path) -> Path:
    """jpg + cls shards (train: 20 samples, keys in a dotted folder; test: 9), label == sample
    number, written by `webdataset.ShardWriter` (PAX headers, mtimes, user names)."""
    out = tmp_path / "wds"
    out.mkdir()
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(N_TRAIN):
            sink.write({"__key__": f"part.v1/s{i:05d}", "jpg": solid_jpeg(i), "cls": str(i)})
    with wds.ShardWriter(str(out / "test-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(N_TEST):
            sink.write({"__key__": f"{i:06d}", "jpg": solid_jpeg(i), "cls": str(i)})
    return out


def caption(i: int) -> str:
    return f"a solid swatch n\u00b0{i} \u2014 caf\u00e9"


def meta(i: int) -> dict:
    return {"id": i, "url": f"http://example.invalid/{i}.jpg", "size": [24, 20], "nsfw": i % 2 == 0}


@pytest.fixture
def caption_shards(tmp_path: Path) -> Path:
    """img2dataset-style jpg + json + txt shards (no cls), 10 samples, written by ShardWriter."""
    out = tmp_path / "captions"
    out.mkdir()
    with wds.ShardWriter(str(out / "%05d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write(
                {"__key__": f"{i:09d}", "jpg": solid_jpeg(i), "json": meta(i), "txt": caption(i)}
            )
    return out
