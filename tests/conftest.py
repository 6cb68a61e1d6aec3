"""Shared fixtures: tiny real datasets built in tmp_path, and the real data when present."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
from fastdata_pipelines.env import data_dir
from PIL import Image

from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource


@pytest.fixture(autouse=True)
def _decoded_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Every test's decoded cache (memory backend) goes to a temp folder, never ~/.cache."""
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path_factory.mktemp("fastdata-cache")))


def unique_label_source(n_train: int = 300, n_test: int = 50, side: int = 8) -> ArraySource:
    """Every sample is its own class (label == sample id), so a label multiset names samples."""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (n_train, side, side, 3), dtype=np.uint8)
    test = rng.integers(0, 256, (n_test, side, side, 3), dtype=np.uint8)
    classes = [f"c{i}" for i in range(max(n_train, n_test))]
    return ArraySource(
        {"train": (train, np.arange(n_train)), "test": (test, np.arange(n_test))}, classes
    )


def rehash_indexes(root: Path):
    """Record each index file's current sha256 in ROOT's manifest (a test that edits an index
    on purpose, to reach the checks behind the index checksum); returns the reloaded manifest."""
    import hashlib
    import json

    from fastdata.format.manifest_io import load_manifest

    path = root / "manifest.json"
    data = json.loads(path.read_text())
    for split in data["splits"].values():
        for shard in split["shards"]:
            shard["index_sha256"] = hashlib.sha256((root / shard["index"]).read_bytes()).hexdigest()
    path.write_text(json.dumps(data))
    return load_manifest(root)


@pytest.fixture
def tiny_shards(tmp_path: Path) -> Path:
    """300 train + 50 test 8x8 raw samples in shards of 64, labels == sample ids."""
    out = tmp_path / "tiny"
    write_shards(unique_label_source(), out, ShardOptions(max_count=64, workers=1, progress=False))
    return out


def quiet_trainer(package=None, **kwargs):
    """A CPU Trainer for one epoch with no logger, checkpoints, progress bar or model summary
    (what most Lightning tests here want); `kwargs` override or add Trainer arguments, `package`
    is `lightning.pytorch` (default) or `pytorch_lightning`."""
    import lightning.pytorch as pl

    settings = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return (package or pl).Trainer(**{**settings, **kwargs})


def write_jpeg_folder(root: Path, classes: int = 3, per_class: int = 4, size=(48, 40)) -> Path:
    """A class-per-folder tree of real JPEG and PNG files."""
    rng = np.random.default_rng(1)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            fmt = "PNG" if i == per_class - 1 else "JPEG"
            Image.fromarray(pixels).save(
                folder / f"img{i}.{fmt.lower()[:3] if fmt == 'PNG' else 'jpg'}", fmt
            )
    return root


def jpeg_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def dali_pipelines(monkeypatch) -> list[dict]:
    """The keyword arguments of every DALI pipeline built while the test runs (DALI tests)."""
    import nvidia.dali

    built: list[dict] = []

    class Counted(nvidia.dali.Pipeline):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(nvidia.dali, "Pipeline", Counted)
    return built


@pytest.fixture
def real_data() -> Path:
    """../shared/data (or $FASTDATA_DATA_DIR); skips the test when it is absent."""
    root = data_dir()
    if not (root / "cifar-100-python.tar.gz").exists() or not (root / "clothing-small").is_dir():
        pytest.skip(
            f"real data not found at {root} (set FASTDATA_DATA_DIR to the shared data folder)"
        )
    return root


#: Tests that start a local Ray cluster: under pytest-xdist (`-n 2 --dist loadgroup`, CI's run)
#: they go to one worker, one after the other (two Ray clusters at once on 2 cores: not tried, not risked).
_ONE_AT_A_TIME = {
    "ray": ("test_engine_ray.py", "test_ray_train.py", "cluster.md", "ray-train.md"),
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (`_ONE_AT_A_TIME`), and the long tests first."""
    for item in items:
        for group, names in _ONE_AT_A_TIME.items():
            if any(name in item.nodeid for name in names):
                item.add_marker(pytest.mark.xdist_group(group))
    # The long tests first (`slow`, and the Ray group as a whole): under pytest-xdist each
    # worker starts on one while the other fills in with short ones, instead of one long test
    # left running alone at the end. A stable sort: the order is otherwise the collection's.
    items.sort(key=lambda item: not _starts_early(item))


def _starts_early(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in ("slow", "xdist_group"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one skip of optional hardware: `gpu` tests without CUDA, `dali` tests without DALI.

    (`heavy` tests are left out by pyproject's addopts, ``-m "not heavy"``; a ``-m`` given on
    the command line replaces it: ``-m "heavy or not heavy"`` runs everything.)
    """
    if item.get_closest_marker("gpu") is not None and not _cuda():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("dali") is not None and not _dali():
        pytest.skip("needs NVIDIA DALI (nvidia-dali-cuda120), which does not import here")


@functools.cache
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def _dali() -> bool:
    try:  # imported, not only found: a broken install must skip, not fail
        import nvidia.dali  # noqa: F401
    except Exception:
        return False
    return True
