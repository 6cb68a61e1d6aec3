"""Other tools' jpg + json + txt shards (img2dataset-style, written by webdataset's ShardWriter)
through `fastdata index` and the DataModule: dict batches with every sample once per epoch, its
own json and text, locally and over HTTP, the tars untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import ShardDataModule, WorkerSettings
from fastdata.write.index import index_shards
from tests.write.index.conftest import caption, colour, meta, sha256s

N = 10  # caption_shards' samples


def _check_epochs(out: Path, backend: str, num_workers: int = 0) -> None:
    dm = ShardDataModule(
        out,
        batch_size=4,
        workers=WorkerSettings(num_workers=num_workers),
        backend=backend,
        verify_samples=backend == "cpu",
        image_size=16,
        train_transforms="none",
        drop_last=False,  # 10 samples in batches of 4: the last step has 2
    )
    dm.setup("fit")
    assert sorted(dm.manifest.split("train").field_specs) == ["image", "json", "text"]
    for _epoch in range(2):
        seen: dict[int, int] = {}
        for batch in dm.train_dataloader():
            assert isinstance(batch, dict) and batch["image"].dtype == torch.uint8
            assert batch["image"].shape[1:] == (3, 16, 16)
            rows = zip(batch["image"], batch["json"], batch["text"], batch["padded"], strict=True)
            for image, value, text, padded in rows:
                assert not bool(padded)
                number = value["id"]
                assert value == meta(number) and text == caption(number)
                pixel = image[:, 8, 8].numpy().astype(int)
                assert np.abs(pixel - np.array(colour(number))).max() <= 8, (number, pixel)
                seen[number] = seen.get(number, 0) + 1
        assert seen == {i: 1 for i in range(N)}  # every sample once per epoch
    dm.teardown()


@pytest.mark.parametrize("backend, workers", [("cpu", 0), ("cpu", 2), ("memory", 0)])
def test_caption_shards_through_the_datamodule(caption_shards, tmp_path, backend, workers):
    before = sha256s(caption_shards)
    index_shards(caption_shards, tmp_path / "out")
    _check_epochs(tmp_path / "out", backend, workers)
    assert sha256s(caption_shards) == before


def test_caption_shards_over_http_through_the_datamodule(caption_shards, tmp_path):
    pytest.importorskip("aiohttp")
    from tests.remote.servers import FileServer

    before = sha256s(caption_shards)
    server = FileServer(caption_shards)
    try:
        listed = tmp_path / "urls.txt"
        listed.write_text("".join(f"{server.url}/{n}\n" for n in sorted(before)))
        manifest = index_shards(listed, tmp_path / "out")
        assert manifest.data_root == server.url
        _check_epochs(tmp_path / "out", "cpu")
    finally:
        server.stop()
    assert sha256s(caption_shards) == before
