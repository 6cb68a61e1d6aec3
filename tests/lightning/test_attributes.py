"""num_classes, classes, image_shape: read from the manifest, before setup() too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest import ManifestError
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.folder import FolderSource
from tests.conftest import write_jpeg_folder


def _first_batch_shape(dm: ShardDataModule) -> tuple[int, ...]:
    """(C, H, W) of a training batch as the model receives it (after the device transforms)."""
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    x, _ = dm.on_after_batch_transfer((x, y), 0)
    return tuple(x.shape[1:])


def test_before_setup_they_read_the_manifest_only(tiny_shards):
    dm = ShardDataModule(
        tiny_shards, batch_size=32, backend="cpu", workers=WorkerSettings(num_workers=0)
    )
    assert dm.num_classes == 300
    assert dm.classes[:3] == ["c0", "c1", "c2"] and len(dm.classes) == 300
    assert dm.image_shape == (3, 8, 8)
    assert dm.manifest is None and dm.backend_name is None  # no setup, no backend chosen
    assert _first_batch_shape(dm) == dm.image_shape == (3, 8, 8)
    assert dm.num_classes == 300


def _folder_shards(tmp_path: Path, mixed_sizes: bool, size: tuple[int, int]) -> Path:
    src = write_jpeg_folder(tmp_path / "imgs", classes=2, per_class=3, size=size)
    if mixed_sizes:
        pixels = np.random.default_rng(2).integers(0, 256, (50, 70, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(src / "class1" / "img0.jpg", "JPEG")
    out = tmp_path / "shards"
    write_shards(FolderSource(src), out, ShardOptions(workers=1, progress=False))
    return out


@pytest.mark.parametrize(
    ("size", "mixed_sizes", "options", "expected"),
    [
        ((48, 40), False, {}, (3, 40, 48)),  # small fixed-size images keep their size (cifar)
        ((96, 80), False, {}, (3, 224, 224)),  # larger ones are photos: 224 squared
        ((96, 80), False, {"image_size": 48}, (3, 48, 48)),  # ... or image_size squared
        ((96, 80), True, {}, (3, 224, 224)),  # varying sizes: the default side
        ((96, 80), True, {"image_size": 40, "train_transforms": "photo"}, (3, 40, 40)),
    ],
)
def test_image_shape_is_what_the_model_receives(tmp_path, size, mixed_sizes, options, expected):
    root = _folder_shards(tmp_path, mixed_sizes, size)
    dm = ShardDataModule(
        root, batch_size=2, backend="cpu", workers=WorkerSettings(num_workers=0), **options
    )
    assert dm.image_shape == expected and dm.num_classes == 2
    assert dm.classes == ["class0", "class1"]
    assert _first_batch_shape(dm) == expected == dm.image_shape


def test_a_missing_manifest_is_named(tmp_path):
    dm = ShardDataModule(tmp_path / "nowhere", workers=WorkerSettings(num_workers=0))
    with pytest.raises(ManifestError, match="nowhere"):
        dm.num_classes  # noqa: B018
