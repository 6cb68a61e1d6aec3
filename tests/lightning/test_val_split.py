"""A val split for every dataset: `ShardDataModule(val=...)` carving, its resume fingerprint,
`fastdata shard --val-fraction`, the 0..1-scale statistics warning, the decoded cache location."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from fastdata import WorkerSettings
from fastdata.cli import main
from fastdata.format.carve import Carve, carve_ids
from fastdata.format.manifest_io import load_manifest
from fastdata.lightning.datamodule import ShardDataModule
from fastdata.read.backends.memory import clear_device_cache
from fastdata.read.plan import PAD_LABEL, PlanConfig, plan_epoch
from fastdata.read.resume import ResumeError
from fastdata.write import ShardOptions, write_shards
from tests.conftest import unique_label_source, write_jpeg_folder

N_TRAIN = 300  # tiny_shards: 300 train samples, label == sample id, in shards of 64


def _module(root: Path, **kwargs) -> ShardDataModule:
    options = dict(
        batch_size=16, workers=WorkerSettings(num_workers=0, prefetch_factor=2), backend="cpu"
    )
    return ShardDataModule(root, **{**options, **kwargs})


def _labels(dm: ShardDataModule, role: str, epoch: int = 0) -> list[int]:
    """Every label `role`'s loader yields in `epoch` (tiny_shards: label == sample id)."""
    dm.setup()
    loader = dm.train_dataloader() if role == "train" else dm.val_dataloader()
    loader.set_epoch(epoch)
    device = torch.device("cpu")
    out: list[int] = []
    for batch in loader:
        _, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, device, 0), 0)
        out.extend(int(v) for v in y if v != PAD_LABEL)
    return out


# ---------------------------------------------------------------- carving


@pytest.mark.parametrize("shuffle", [True, False])
def test_plan_with_a_carve_reads_one_side_on_every_world_size(shuffle):
    sizes = [64, 64, 64, 64, 44]
    carved = set(carve_ids(300, 0.2, 7)[1].tolist())
    for side in ("train", "val"):
        wanted = carved if side == "val" else set(range(300)) - carved
        for world in (1, 2, 3):
            rows: set[int] = set()
            for rank in range(world):
                config = PlanConfig(7, rank, world, 16, shuffle, carve=Carve(0.2, 7, side))
                plan = plan_epoch(sizes, config, epoch=1)
                rows |= {int(r) for b in plan.rows for r in b}
                assert plan.total == len(wanted)
            assert rows == wanted, (side, world)


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_val_fraction_never_trains_on_the_carved_samples(tiny_shards, backend):
    first_val = None
    for world in (1, 2, 3):
        train: list[int] = []
        val: list[int] = []
        for rank in range(world):
            dm = _module(
                tiny_shards, val=0.2, backend=backend, rank=rank, world_size=world, drop_last=False
            )
            for epoch in (0, 1):
                train += _labels(dm, "train", epoch)
            val += _labels(dm, "val")
        assert len(val) == len(set(val)) == 60  # every carved sample once, padding excluded
        assert not set(train) & set(val), f"world size {world}: carved samples trained on"
        assert set(train) | set(val) == set(range(N_TRAIN))
        first_val = first_val or set(val)
        assert set(val) == first_val, f"world size {world} carves other samples"
    # Another run (a fresh module, another training seed): the same carve.
    again = _module(tiny_shards, val=0.2, backend=backend, seed=5)
    assert set(_labels(again, "val")) == first_val


@pytest.mark.dali
def test_dali_backend_honours_the_carve(tiny_shards):
    dm = _module(
        tiny_shards,
        val=0.2,
        backend="dali",
        workers=WorkerSettings(num_workers=1, prefetch_factor=2),
        drop_last=False,
    )
    train, val = _labels(dm, "train"), _labels(dm, "val")
    assert len(train) == len(set(train)) == 240 and len(val) == len(set(val)) == 60
    assert set(val) == set(_labels(_module(tiny_shards, val=0.2), "val"))  # as the cpu backend
    assert not set(train) & set(val)


def test_val_fraction_over_a_dataset_with_a_val_split_says_which_it_uses(tmp_path, caplog):
    options = ShardOptions(max_count=64, workers=1, progress=False, val_fraction=0.2)
    root = tmp_path / "with-val"
    write_shards(unique_label_source(), root, options)
    with caplog.at_level("WARNING", logger="fastdata"):
        val = _labels(_module(root, val=0.1), "val")
    assert "has a 'val' split, but val=0.1" in caplog.text and len(val) == 24  # 10 % of 240


def test_val_splits_and_carves_refuse_what_they_cannot_do(tiny_shards):
    dm = _module(tiny_shards, splits={"val": "test"})
    assert len(_labels(dm, "val")) == 50
    with pytest.raises(ValueError, match="'nope' is not in"):
        _module(tiny_shards, splits={"val": "nope"}).setup()
    with pytest.raises(ValueError, match="disagree"):
        _module(tiny_shards, val=0.1, splits={"val": "test"}).setup()
    with pytest.raises(ValueError, match="cannot carve a mix"):
        _module([tiny_shards, tiny_shards], val=0.1)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        _module(tiny_shards, val=1.0)


class PlateauModel(pl.LightningModule):
    """Monitors val_loss (ReduceLROnPlateau): fails at the first epoch end without validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, N_TRAIN))
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.trained.extend(y.tolist())
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"},
        }


def test_a_module_monitoring_val_loss_trains_with_val_fraction(tiny_shards, tmp_path):
    dm = _module(tiny_shards, val=0.1, backend="memory")
    model = PlateauModel()
    checkpoint = pl.callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="val_loss")
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, callbacks=[checkpoint],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert "val_loss" in trainer.callback_metrics and checkpoint.best_model_path
    val = set(_labels(dm, "val"))
    assert len(val) == 30 and not val & set(model.trained)


def test_resume_with_another_val_fraction_is_refused(tiny_shards):
    full = _module(tiny_shards, val=0.1)
    epoch0 = [y.tolist() for _, y in full.train_dataloader()]
    partial = _module(tiny_shards, val=0.1)
    device = torch.device("cpu")
    for step, batch in enumerate(partial.train_dataloader(), start=1):
        partial.on_after_batch_transfer(partial.transfer_batch_to_device(batch, device, 0), 0)
        if step == 3:
            break
    state = partial.state_dict()
    assert state["num_samples"] == 270 and state["consumed"] == 48
    resumed = _module(tiny_shards, val=0.1)
    resumed.load_state_dict(state)
    assert [y.tolist() for _, y in resumed.train_dataloader()] == epoch0[3:]
    for other in (0.2, None):
        with pytest.raises(ResumeError, match="val= carve"):
            _module(tiny_shards, val=other).load_state_dict(state)
    uncarved = _module(tiny_shards).state_dict()
    with pytest.raises(ResumeError, match="val= carve"):
        _module(tiny_shards, val=0.1).load_state_dict(uncarved)


def test_no_val_split_warning_suggests_val(tiny_shards, caplog):
    with caplog.at_level("WARNING", logger="fastdata"):
        assert _module(tiny_shards).val_dataloader() == []
    assert "val=0.1" in caplog.text and "--val-fraction" in caplog.text


# ---------------------------------------------------------------- fastdata shard --val-fraction


def _labels_of(root: Path, split: str) -> list[int]:
    dm = _module(root, splits={"val": split} if split != "train" else None)
    return _labels(dm, "train" if split == "train" else "val")


def test_shard_val_fraction_writes_a_seeded_disjoint_val_split(tmp_path):
    options = ShardOptions(max_count=64, workers=1, progress=False, val_fraction=0.2, seed=3)
    manifest = write_shards(unique_label_source(), tmp_path / "a", options)
    assert {n: s.num_samples for n, s in manifest.splits.items()} == {
        "train": 240, "val": 60, "test": 50,
    }  # fmt: skip
    assert manifest.source["options"]["val_fraction"] == 0.2
    train, val = _labels_of(tmp_path / "a", "train"), _labels_of(tmp_path / "a", "val")
    assert not set(train) & set(val) and set(train) | set(val) == set(range(N_TRAIN))
    assert set(val) == set(carve_ids(N_TRAIN, 0.2, 3)[1].tolist())
    same = write_shards(unique_label_source(), tmp_path / "b", options)
    assert [s.sha256 for s in same.splits["val"].shards] == [
        s.sha256 for s in manifest.splits["val"].shards
    ]  # deterministic with the seed
    reseeded = ShardOptions(max_count=64, workers=1, progress=False, val_fraction=0.2, seed=4)
    write_shards(unique_label_source(), tmp_path / "c", reseeded)
    assert set(_labels_of(tmp_path / "c", "val")) != set(val)


def test_shard_cli_val_fraction_on_a_folder(tmp_path, capsys):
    images = write_jpeg_folder(tmp_path / "images", classes=3, per_class=4)
    out = tmp_path / "out"
    argv = ["shard", "folder", str(images), str(out), "--val-fraction", "0.25", "--no-progress"]
    assert main([*argv, "--workers", "1"]) == 0
    manifest = load_manifest(out)
    assert {n: s.num_samples for n, s in manifest.splits.items()} == {"train": 9, "val": 3}
    assert sum(manifest.splits["val"].class_counts) == 3
    dm = ShardDataModule(
        out, batch_size=4, backend="cpu", image_size=32, workers=WorkerSettings(num_workers=0)
    )
    dm.setup()
    assert dm.split_names["val"] == "val"
    # A source that has a val split already, and a bad fraction, are refused with the reason.
    (tmp_path / "split").mkdir()
    shutil.copytree(images, tmp_path / "split" / "train")
    shutil.copytree(images, tmp_path / "split" / "val")
    argv = ["shard", "folder", str(tmp_path / "split"), str(tmp_path / "o2"), "--no-progress"]
    assert main([*argv, "--val-fraction", "0.25"]) == 2
    assert "already has a 'val' split" in capsys.readouterr().err
    argv = ["shard", "folder", str(images), str(tmp_path / "o3"), "--no-progress"]
    assert main([*argv, "--val-fraction", "1.5"]) == 2
    assert "--val-fraction=1.5" in capsys.readouterr().err


# ---------------------------------------------------------------- statistics on the 0..1 scale


def test_unit_scale_mean_std_warns_with_the_x255_values(tiny_shards, caplog):
    with caplog.at_level("WARNING", logger="fastdata"):
        _module(tiny_shards, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)).setup()
    assert caplog.text.count("0..1 scale") == 1
    assert "mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastdata"):
        _module(tiny_shards, mean=(123.7, 116.3, 103.5), std=(58.4, 57.1, 57.4)).setup()
    assert "0..1 scale" not in caplog.text
    with caplog.at_level("WARNING", logger="fastdata"):
        _module(tiny_shards, std=(0.229, 0.224, 0.225)).setup()  # one of them given: checked too
    assert "pass std=[58.395, 57.12, 57.375]" in caplog.text


# ---------------------------------------------------------------- decoded cache location


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode for p in root.rglob("*")}


def test_memory_backend_never_writes_into_a_read_only_dataset(tiny_shards, tmp_path, monkeypatch):
    data = tmp_path / "readonly"
    shutil.copytree(tiny_shards, data)
    for path in [data, *data.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = _tree(data)
    monkeypatch.delenv("FASTDATA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        dm = _module(data, val=0.1, backend="memory")
        assert len(_labels(dm, "train")) == 16 * (270 // 16)
        assert _tree(data) == before, "the memory backend wrote into the dataset folder"
        entries = list((tmp_path / "xdg" / "fastdata" / "decoded").glob("train-*.json"))
        assert len(entries) == 1
        header = json.loads(entries[0].read_text())
        assert header["num_samples"] == N_TRAIN
    finally:
        for path in [data, *data.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_decoded_cache_dir_option_and_environment(tiny_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "env"))
    _labels(_module(tiny_shards, backend="memory", splits={"val": "test"}), "val")
    assert len(list((tmp_path / "env").glob("test-*.json"))) == 1
    chosen = tmp_path / "chosen"
    clear_device_cache()  # the process keeps placed splits: decode (load) the split again
    _labels(
        _module(tiny_shards, backend="memory", decoded_cache_dir=chosen, splits={"val": "test"}),
        "val",
    )
    assert len(list(chosen.glob("test-*.json"))) == 1
    assert not any(p.name.startswith(".fastdata") for p in tiny_shards.iterdir())
    assert os.access(tiny_shards, os.W_OK)  # nothing above needed a read-only folder
