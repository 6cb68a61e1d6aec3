"""The DALI backend on tiny real shards, with DALI's CPU operators (GPU path: `gpu` marker).

Labels are unique per sample (one class per sample), so a label multiset equal to the split's
proves that an epoch neither loses nor duplicates samples beyond the documented padding.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from fastdata._env import data_dir  # noqa: E402
from fastdata.augment import (  # noqa: E402
    CIFAR100_MEAN,
    CIFAR100_STD,
    crop_with_padding,
    flip_horizontal,
    get_preset,
    normalize,
)
from fastdata.manifest import Manifest  # noqa: E402
from fastdata.read.base import BatchLoader, LoaderSpec  # noqa: E402
from fastdata.read.dali import DaliLoader, make_dali_loader  # noqa: E402
from fastdata.read.plan import num_batches  # noqa: E402
from fastdata.sources.arrays import ArraySource  # noqa: E402
from fastdata.sources.folder import FolderSource  # noqa: E402
from fastdata.write import ShardOptions, write_shards  # noqa: E402

pytestmark = pytest.mark.dali

REPO = Path(__file__).resolve().parents[2]
N_TRAIN, N_TEST = 23, 9  # odd sizes: DALI's per-rank parts differ by one, padding is needed
OPTIONS = ShardOptions(max_count=5, workers=1, progress=False)


# ---------------------------------------------------------------------------- helpers


def _arrays(n: int, seed: int, hw: tuple[int, int] = (32, 32)) -> tuple[np.ndarray, np.ndarray]:
    pixels = np.random.default_rng(seed).integers(0, 256, (n, *hw, 3), dtype=np.uint8)
    return pixels, np.arange(n)  # one class per sample: labels identify samples


def _write_raw(folder: Path, n_train: int = N_TRAIN, n_test: int = N_TEST) -> Manifest:
    splits = {"train": _arrays(n_train, 0), "test": _arrays(n_test, 1)}
    source = ArraySource(splits, classes=[f"c{i}" for i in range(max(n_train, n_test))])
    return write_shards(source, folder, OPTIONS)


@pytest.fixture(scope="module")
def raw_shards(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return _write_raw(tmp_path_factory.mktemp("dali") / "shards")


@pytest.fixture(scope="module")
def raw_pixels() -> torch.Tensor:
    """The train split's pixels, uint8 NCHW, row i = sample with label i."""
    return torch.from_numpy(_arrays(N_TRAIN, 0)[0]).permute(0, 3, 1, 2).contiguous()


def _spec(manifest: Manifest, **kw) -> LoaderSpec:
    args = dict(manifest=manifest, split="train", train=True, batch_size=4, seed=3, preset="cifar")
    return LoaderSpec(**{**args, **kw})


def _epoch(loader: BatchLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.clone(), labels.clone()) for images, labels in loader]


def _labels(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    return [label for _, labels in batches for label in labels.tolist()]


# ---------------------------------------------------------------------------- epochs and ranks


@pytest.mark.parametrize("train", [True, False])
def test_one_rank_yields_every_sample_once_as_float_nchw(raw_shards, train):
    loader = make_dali_loader(_spec(raw_shards, train=train, drop_last=False))
    assert loader.augmented is True
    batches = _epoch(loader)
    assert len(batches) == len(loader) == math.ceil(N_TRAIN / 4)
    assert sorted(_labels(batches)) == list(range(N_TRAIN))
    images, labels = batches[0]
    assert images.dtype == torch.float32 and images.shape == (4, 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.shape == (4,)


@pytest.mark.parametrize(
    ("n", "world_size", "batch_size", "drop_last"),
    [
        (9, 2, 4, False),  # the smaller part (4) is one full batch: DALI's PARTIAL would yield []
        (9, 2, 4, True),
        (23, 3, 4, False),
        (23, 3, 4, True),
        (10, 4, 3, False),
        (12, 2, 3, True),  # even split, no padding
    ],
)
def test_every_rank_yields_the_same_number_of_batches(
    tmp_path, n, world_size, batch_size, drop_last
):
    manifest = _write_raw(tmp_path / "shards", n_train=n, n_test=3)
    per_rank = math.ceil(n / world_size)
    expected = num_batches(n, world_size, batch_size, drop_last)  # the CPU plan's count
    seen: Counter[int] = Counter()
    for rank in range(world_size):
        spec = _spec(
            manifest, rank=rank, world_size=world_size, batch_size=batch_size, drop_last=drop_last
        )
        batches = _epoch(make_dali_loader(spec))
        labels = _labels(batches)
        assert len(batches) == len(make_dali_loader(spec)) == expected, f"rank {rank}"
        assert all(len(y) == batch_size for _, y in batches[:-1])
        assert len(labels) == (expected * batch_size if drop_last else per_rank)
        assert max(Counter(labels).values()) <= 2  # at most the one padding duplicate
        seen.update(labels)
    if not drop_last:  # the union of the ranks is the whole split, plus the documented padding
        assert set(seen) == set(range(n))
        assert sum(seen.values()) == per_rank * world_size


def test_matches_the_cpu_backend_count_and_label_multiset(raw_shards):
    cpu = pytest.importorskip("fastdata.read.cpu")
    for world_size in (1, 2):
        for rank in range(world_size):
            spec = _spec(raw_shards, rank=rank, world_size=world_size, drop_last=False)
            dali_batches = _epoch(make_dali_loader(spec))
            cpu_loader = cpu.make_cpu_loader(replace(spec, num_workers=0))
            cpu_batches = list(cpu_loader)
            assert len(dali_batches) == len(cpu_batches) == len(cpu_loader)
            if world_size == 1:  # with ranks, the two backends pad with different samples
                assert Counter(_labels(dali_batches)) == Counter(_labels(cpu_batches))
            else:
                assert len(_labels(dali_batches)) == len(_labels(cpu_batches))


def test_new_order_each_epoch_same_order_for_the_same_epoch(raw_shards):
    loader = DaliLoader(_spec(raw_shards, num_workers=2))
    first = _labels(_epoch(loader))
    again = _epoch(loader)  # no set_epoch: the same epoch again
    loader.set_epoch(1)
    second = _labels(_epoch(loader))
    assert _labels(again) == first
    assert second != first and sorted(second) == sorted(first) == list(range(N_TRAIN))


def test_resume_mid_epoch_replays_the_remaining_batches(raw_shards):
    spec = _spec(raw_shards, epoch=2, num_workers=2)
    full = _epoch(DaliLoader(spec))
    resumed_loader = DaliLoader(replace(spec, start_batch=2))
    resumed = _epoch(resumed_loader)
    assert len(resumed_loader) == len(full)  # the whole epoch, as the CPU backend reports
    assert len(resumed) == len(full) - 2
    for (xa, ya), (xb, yb) in zip(full[2:], resumed, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
    assert len(_epoch(resumed_loader)) == len(full)  # the next pass is a whole epoch


# ---------------------------------------------------------------------------- presets


def test_cifar_eval_is_the_augment_preset(raw_shards, raw_pixels):
    batches = _epoch(make_dali_loader(_spec(raw_shards, train=False)))
    images = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    expected = get_preset("cifar").apply(raw_pixels[labels], train=False)
    torch.testing.assert_close(images, expected, atol=1e-5, rtol=0)


def _pad_crop_flip_candidates(pixels: torch.Tensor) -> torch.Tensor:
    """All 81 x 2 outcomes of the cifar train preset for one uint8 CHW image, normalized."""
    n = 9 * 9 * 2
    offsets = torch.tensor([[dy, dx] for dy in range(9) for dx in range(9)] * 2)
    flips = torch.arange(n) >= n // 2
    batch = pixels[None].expand(n, *pixels.shape)
    crops = flip_horizontal(crop_with_padding(batch, 4, offsets), flips)
    return normalize(crops, CIFAR100_MEAN, CIFAR100_STD)


def test_cifar_train_is_a_padded_crop_and_flip_of_the_source(raw_shards, raw_pixels):
    batches = _epoch(make_dali_loader(_spec(raw_shards, train=True)))
    outcomes = set()
    for images, labels in batches:
        for image, label in zip(images, labels, strict=True):
            candidates = _pad_crop_flip_candidates(raw_pixels[label])
            error = (candidates - image).abs().flatten(1).amax(dim=1)
            assert error.min() < 1e-4, f"sample {label} is no padded crop / flip of its source"
            outcomes.add(int(error.argmin()))
    assert len(outcomes) > N_TRAIN // 2  # random offsets and flips, not one fixed choice


def _photo_shards(tmp_path: Path, per_class: int = 3) -> Manifest:
    source_root = data_dir() / "clothing-small"
    if not source_root.is_dir():
        pytest.skip(f"real data not found at {source_root} (set FASTDATA_DATA_DIR)")
    root = tmp_path / "photos"
    for split in ("train", "test"):
        for cls in ("hat", "shoes"):
            files = sorted((source_root / split / cls).glob("*.jpg"))[:per_class]
            (root / split / cls).mkdir(parents=True)
            for f in files:
                shutil.copy(f, root / split / cls / f.name)
    return write_shards(FolderSource(root), tmp_path / "shards", OPTIONS)


@pytest.mark.realdata
@pytest.mark.parametrize("train", [True, False])
def test_photo_preset_on_real_jpegs(tmp_path, train):
    manifest = _photo_shards(tmp_path)
    assert manifest.split("train").encoding == "jpeg"
    spec = _spec(manifest, train=train, preset="photo", image_size=(64, 64), batch_size=4)
    batches = _epoch(make_dali_loader(spec))
    images = torch.cat([x for x, _ in batches])
    assert images.shape == (6, 3, 64, 64) and images.dtype == torch.float32
    assert torch.isfinite(images).all()
    assert -3 < images.mean().item() < 3 and images.std().item() > 0.1  # ImageNet-normalized
    assert sorted(_labels(batches)) == [0, 0, 0, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.realdata
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_photo_preset_decodes_on_the_gpu(tmp_path):
    manifest = _photo_shards(tmp_path)
    spec = _spec(manifest, preset="photo", image_size=(64, 64), device="cuda:0")
    with DaliLoader(spec) as loader:
        assert loader.gpu
        images, labels = next(iter(loader))
        assert images.device.type == "cuda" and images.shape == (4, 3, 64, 64)


# ---------------------------------------------------------------------------- errors


def test_missing_index_names_the_shard(tmp_path):
    manifest = _write_raw(tmp_path / "shards")
    shard = manifest.split("train").shards[1]
    os.remove(manifest.index_url(shard))
    with pytest.raises(ValueError, match=rf"{shard.name}.*re-run `fastdata shard`"):
        make_dali_loader(_spec(manifest))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"on_error": "skip"}, "cannot skip"),
        ({"preset": "photo_device"}, "presets"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_spec_is_a_value_error(raw_shards, change, match):
    with pytest.raises(ValueError, match=match):
        make_dali_loader(_spec(raw_shards, **change))


def test_fastdata_imports_without_dali(raw_shards):
    code = textwrap.dedent(
        f"""
        import sys
        import fastdata.read.dali as dali
        assert "nvidia.dali" not in sys.modules, "importing the backend module imported DALI"
        sys.modules["nvidia.dali"] = None  # DALI now cannot be imported
        import fastdata
        from fastdata.manifest import load_manifest
        from fastdata.read import get_backend
        from fastdata.read.base import LoaderSpec
        assert not dali.dali_available()
        spec = LoaderSpec(load_manifest({str(raw_shards.root)!r}), "train", True, 4)
        try:
            get_backend("dali")(spec)
        except ImportError as exc:
            assert "pip install fastdata[dali]" in str(exc), exc
        else:
            raise AssertionError("no ImportError without DALI")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------- real DDP

_DDP_SCRIPT = """
import json, sys
import lightning as L
import torch
from fastdata.manifest import load_manifest
from fastdata.read.base import LoaderSpec
from fastdata.read.dali import make_dali_loader

ROOT, OUT = sys.argv[1], sys.argv[2]


class Probe(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = {}

    def train_dataloader(self):
        spec = LoaderSpec(
            load_manifest(ROOT), "train", True, batch_size=4, seed=5, preset="cifar",
            rank=self.trainer.global_rank, world_size=self.trainer.world_size, num_workers=1,
        )
        self.loader = make_dali_loader(spec)
        return self.loader

    def on_train_epoch_start(self):
        self.loader.set_epoch(self.current_epoch)
        self.seen[self.current_epoch] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen[self.current_epoch].append(labels.tolist())
        return (self.weight * images.mean()).sum()  # a real all-reduce every step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_end(self):
        record = {"len": len(self.loader), "seen": self.seen}
        with open(f"{OUT}/rank{self.global_rank}.json", "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Probe())
"""


@pytest.mark.slow
def test_two_process_ddp_ranks_get_equal_batches_and_the_whole_split(tmp_path, raw_shards):
    script = tmp_path / "ddp_probe.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        ["timeout", "240", sys.executable, str(script), str(raw_shards.root), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = num_batches(N_TRAIN, 2, 4, drop_last=False)
    for epoch in ("0", "1"):
        batches = [record["seen"][epoch] for record in records]
        assert [len(b) for b in batches] == [expected, expected]
        labels = [label for b in batches for batch in b for label in batch]
        assert set(labels) == set(range(N_TRAIN)) and len(labels) == 2 * math.ceil(N_TRAIN / 2)
    assert records[0]["seen"]["0"] != records[0]["seen"]["1"]  # a new shuffle every epoch
    assert [r["len"] for r in records] == [expected, expected]
