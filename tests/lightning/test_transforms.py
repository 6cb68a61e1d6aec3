"""Sizes and transforms that work on every backend (image_size, callables, what loaders yield)."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.augment import BatchTransform, image_seed
from fastdata.read import BACKENDS as ALL_BACKENDS
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source

BACKENDS = ["cpu", "memory"]
LOCAL = BACKENDS + (["dali"] if ALL_BACKENDS["dali"].check()[0] else [])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def png8(tmp_path_factory) -> Path:
    """300 train + 50 test 8x8 PNG samples (labels == sample ids)."""
    out = tmp_path_factory.mktemp("png8") / "shards"
    options = ShardOptions(max_count=64, workers=1, progress=False, encoding="png")
    write_shards(unique_label_source(), out, options)
    return out


@pytest.fixture(scope="module")
def raw8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("raw8") / "shards"
    write_shards(unique_label_source(), out, ShardOptions(max_count=64, workers=1, progress=False))
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """24 JPEG photos of 48x40 (train) and 8 (val), listed with labels == ids."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(3)
    with open(root / "list.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["path", "label", "split"])
        for i in range(32):
            name = f"img{i}.jpg"
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / name)
            rows.writerow([name, i, "train" if i < 24 else "val"])
    from fastdata.write.sources.listfile import ListSource

    out = root / "shards"
    write_shards(ListSource(root / "list.csv"), out, ShardOptions(workers=1, progress=False))
    return out


def _dm(root: Path, backend: str, **kw) -> ShardDataModule:
    kw.setdefault("batch_size", 10)
    kw.setdefault("workers", WorkerSettings(num_workers=0))
    dm = ShardDataModule(root, backend=backend, **kw)
    dm.setup("fit")
    return dm


# ---------------------------------------------------------------- case 4: sizes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transforms", ["cifar", "none"])
def test_image_size_equal_to_the_images_own_size(png8, backend, transforms):
    dm = _dm(png8, backend, image_size=8, train_transforms=transforms)
    for loader in (dm.train_dataloader(), dm.test_dataloader()):
        x, y = next(iter(dm.prepared(loader)))
        assert x.shape == (10, 3, 8, 8) and x.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_smaller_image_size_resizes_encoded_images_while_decoding(png8, backend):
    dm = _dm(png8, backend, image_size=7, train_transforms="cifar")
    x, _ = next(iter(dm.prepared(dm.train_dataloader())))
    assert x.shape == (10, 3, 7, 7)


def test_raw_images_of_another_size_are_refused_at_setup(raw8):
    with pytest.raises(ValueError, match=r"8x8, which are not resized.*image_size=None"):
        _dm(raw8, "cpu", image_size=6, train_transforms="cifar")
    dm = _dm(raw8, "cpu", image_size=6, train_transforms="photo")  # a crop to 6: fine
    assert next(iter(dm.prepared(dm.train_dataloader())))[0].shape == (10, 3, 6, 6)


def _brighten(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * 1.1).clamp(0, 255)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callable_without_eval_transforms_validates_photos(photos, backend):
    dm = _dm(photos, backend, image_size=32, train_transforms=_brighten, batch_size=4)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        x, _ = next(iter(dm.prepared(loader)))
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32


@pytest.mark.parametrize(
    ("data", "kw", "hw"),
    [
        ("raw8", {"train_transforms": "cifar"}, (8, 8)),
        ("photos", {"train_transforms": "photo", "image_size": 24}, (24, 24)),
    ],
)
def test_every_backend_loader_yields_uint8_at_the_output_size(request, data, kw, hw):
    root, raw, done = request.getfixturevalue(data), {}, {}
    for backend in LOCAL:
        raw[backend] = next(iter(_dm(root, backend, seed=5, **kw).train_dataloader()))
        dm = _dm(root, backend, seed=5, **kw)
        done[backend] = next(iter(dm.prepared(dm.train_dataloader())))
    for backend, (x, y) in raw.items():
        assert (x.dtype, tuple(x.shape[1:]), y.dtype) == (torch.uint8, (3, *hw), torch.int64), (
            backend
        )
    assert all(torch.equal(raw["cpu"][1], y) for _, y in raw.values())
    if data == "raw8":  # the same pixels in the end: memory's fused crop, cpu's on the device
        assert torch.allclose(done["cpu"][0], done["memory"][0], atol=1e-5)


# ---------------------------------------------------------------- case 5: per-image draws


def coin_flip(x: torch.Tensor) -> torch.Tensor:
    """Like a torchvision v2 RandomHorizontalFlip: one draw of torch's global generator per call."""
    return x.flip(-1) if bool(torch.rand(1) < 0.5) else x


def _flipped(raw: torch.Tensor, out: torch.Tensor) -> list[bool]:
    return [bool(torch.equal(o, r.flip(-1).float())) for r, o in zip(raw, out, strict=True)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callable_draws_per_image_and_repeats_for_a_seed(raw8, backend):
    runs = []
    for _ in range(2):
        dm = _dm(raw8, backend, train_transforms=coin_flip, mean=(0,) * 3, std=(1,) * 3, seed=3)
        loader = dm.train_dataloader()
        raw, y = next(iter(loader))
        x, _ = dm.on_after_batch_transfer((raw, y), 0)
        flips = _flipped(raw, x)
        assert all(f or torch.equal(o, r.float()) for f, o, r in zip(flips, x, raw, strict=True))
        assert 0 < sum(flips) < len(flips), "images of one batch must get their own draws"
        runs.append(x)
    assert torch.equal(*runs)


def test_batch_transform_seeds_each_image_from_the_batch_seed_and_its_index():
    x = torch.randint(0, 256, (16, 3, 4, 4), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(11)
    out = BatchTransform(coin_flip)(x, None, generator)
    for i in range(16):
        torch.manual_seed(image_seed(11, i))
        assert torch.equal(out[i : i + 1], coin_flip(x[i : i + 1]))
    whole = BatchTransform(coin_flip, per_sample=False)(x, None, generator)
    assert len(set(_flipped(x, whole.float()))) == 1  # one draw for the batch: the opt-out


def test_a_callable_returning_images_of_different_sizes_is_named():
    def ragged(x: torch.Tensor) -> torch.Tensor:
        return x[..., : int(torch.randint(2, 5, (1,)))]

    x = torch.zeros((8, 3, 4, 4), dtype=torch.uint8)
    with pytest.raises(ValueError, match="'ragged'.*same size"):
        BatchTransform(ragged)(x, None, torch.Generator().manual_seed(0))


def test_photos_are_stored_with_room_only_for_presets_that_crop(photos):
    from fastdata.augment import get_preset
    from fastdata.format.manifest_io import load_manifest
    from fastdata.read.backends.memory import resident_nbytes

    info = load_manifest(photos).split("train")
    n = info.num_samples
    assert resident_nbytes(info, 224, get_preset("photo", 224)) == n * 3 * 256 * 256
    assert resident_nbytes(info, 224, get_preset("none", 224)) == n * 3 * 224 * 224
    assert resident_nbytes(info, 224, get_preset("cifar", 224), train=False) == n * 3 * 224 * 224


def test_a_resumed_run_repeats_the_per_image_draws(raw8):
    kw = dict(train_transforms=coin_flip, mean=(0,) * 3, std=(1,) * 3, seed=4)
    dm = _dm(raw8, "cpu", **kw)
    batches = list(itertools.islice(dm.prepared(dm.train_dataloader(), CPU), 3))
    state = ShardDataModule(raw8, batch_size=10, workers=WorkerSettings(num_workers=0), **kw)
    state.setup("fit")
    list(itertools.islice(state.prepared(state.train_dataloader(), CPU), 2))
    resumed = ShardDataModule(raw8, batch_size=10, workers=WorkerSettings(num_workers=0), **kw)
    resumed.load_state_dict(state.state_dict())
    resumed.setup("fit")
    raw, y = next(iter(resumed.train_dataloader()))
    x, labels = resumed.on_after_batch_transfer((raw, y), 0)
    assert torch.equal(labels, batches[2][1]) and torch.equal(x, batches[2][0])
    assert 0 < sum(_flipped(raw, x)) < len(raw)
