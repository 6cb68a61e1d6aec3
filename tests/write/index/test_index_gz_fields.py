"""`.gz` components of every field kind (issue 36): a webdataset `ShardWriter` tar holding
`jpg`, `cls`, `txt.gz` and `json.gz`, and the other kinds compressed or not in turn, through
`fastdata index`, the loaders, `fastdata verify` and `fastdata inspect`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.cli import main
from tests.write.index.conftest import wds


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((16, 12, 3), 10 * i, np.uint8)).save(out, "JPEG", quality=95)
    return out.getvalue()


def _labels(i: int) -> np.ndarray:
    return np.asarray([i % 3, 3], dtype=np.int64)


def _features(i: int) -> np.ndarray:
    return np.arange(4, dtype=np.float32) + i


#: Each field's component (without .gz), its value for sample i as written, and what the
#: batch holds for it.
_VALUES = {
    "cls": (lambda i: i % 4, lambda batch, row: int(batch["label"][row])),
    "txt": (lambda i: f"caption {i}", lambda batch, row: batch["text"][row]),
    "json": (lambda i: {"i": i, "tags": ["a"]}, lambda batch, row: batch["json"][row]),
    "npy": (_features, lambda batch, row: batch["array"][row].cpu().numpy()),
    # a labels field is batched multi-hot over the manifest's classes
    "labels.npy": (_labels, lambda batch, row: np.flatnonzero(batch["labels"][row].cpu())),
}


def _shards(folder, compressed: set[str]) -> None:
    folder.mkdir()
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(5):
            sample = {"__key__": f"{i:04d}", "jpg": _jpeg(i)}
            for comp in compressed | {"cls"} if "cls.gz" not in compressed else compressed:
                inner = comp.removesuffix(".gz")
                sample[comp] = _VALUES[inner][0](i)
            sink.write(sample)


@pytest.mark.parametrize(
    "compressed",
    [
        {"txt.gz", "json.gz"},  # the sample: jpg, cls, txt.gz, json.gz
        {"cls.gz", "txt", "json.gz", "npy.gz", "labels.npy"},
        {"txt.gz", "json", "npy", "labels.npy.gz"},
    ],
    ids=["issue", "cls-npy-gz", "labels-gz"],
)
def test_gz_components_index_load_verify_and_inspect(tmp_path, capsys, compressed):
    _shards(tmp_path / "src", compressed)
    out = tmp_path / "out"
    assert main(["index", str(tmp_path / "src"), "--out", str(out), "--workers", "1"]) == 0
    assert main(["verify", str(out), "--no-progress"]) == 0
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "checked 2 shards, 5 samples: OK" in printed and "problem" not in printed
    for backend in ("cpu", "memory"):
        dm = ShardDataModule(
            out,
            batch_size=2,
            backend=backend,
            drop_last=False,
            train_transforms="none",
            workers=WorkerSettings(num_workers=0),
        )
        dm.setup("fit")
        seen = set()
        for batch in dm.train_dataloader():
            for row in range(len(batch["text"])):
                i = batch["json"][row]["i"] if "json" in batch else None
                i = int(batch["label"][row]) if i is None else i
                for comp in {c.removesuffix(".gz") for c in compressed} | {"cls"}:
                    value, read = _VALUES[comp]
                    if comp == "cls":
                        assert read(batch, row) == i % 4
                    else:
                        np.testing.assert_equal(read(batch, row), value(i))
                assert torch.is_tensor(batch["image"]) and batch["image"].shape[1:] == (3, 16, 12)
                seen.add(i)
        dm.teardown()
        assert seen == set(range(5)), backend
