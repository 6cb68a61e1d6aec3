"""LightningCLI (both packages) builds ShardDataModule from command-line arguments and fits."""

from __future__ import annotations

import inspect
import json
import sys

import pytest

from fastdata import (
    DetectionDataModule,
    SegmentationDataModule,
    ShardDataModule,
    WorkerSettings,
)
from tests.lightning.models import PACKAGES, lightning_package, small_cnn

pytest.importorskip("jsonargparse")
pytest.importorskip("pytorch_lightning")


@pytest.mark.parametrize("package", PACKAGES)
def test_lightning_cli_fits_with_shard_datamodule(tiny_shards, tmp_path, package, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # only `args` below, not pytest's own
    pkg = lightning_package(package)
    cli_module = lightning_package(f"{package}.cli")
    args = [
        "fit",
        f"--data.root={tiny_shards}",
        "--data.batch_size=16",
        "--data.workers.num_workers=0",
        "--data.workers.prefetch_factor=2",
        "--data.backend=cpu",
        "--data.train_transforms=cifar",
        f"--data.splits={json.dumps({'val': 'test'})}",
        "--model.lr=0.05",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=1",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    cli = cli_module.LightningCLI(
        small_cnn(pkg), ShardDataModule, args=args, save_config_callback=None
    )
    dm = cli.datamodule
    assert isinstance(dm, ShardDataModule) and isinstance(dm, pkg.LightningDataModule)
    assert dm.batch_size == 16 and dm.split_names["val"] == "test" and cli.model.lr == 0.05
    assert [len(batch) for batch in cli.model.seen] == [16, 16, 16]
    assert cli.trainer.global_step == 3 and cli.model.val_seen


@pytest.mark.parametrize("member", [SegmentationDataModule, DetectionDataModule])
def test_family_members_have_the_base_modules_typed_signature(member):
    signature = inspect.signature(member)
    kinds = {p.kind for p in signature.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds  # no option hidden behind **kwargs
    assert signature == inspect.signature(ShardDataModule)
    assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values())
    assert signature.parameters["ignore_index"].default == 255


@pytest.mark.parametrize("member", [SegmentationDataModule, DetectionDataModule])
def test_lightning_cli_sees_every_family_members_option(member, tmp_path, monkeypatch):
    """LightningCLI builds a family member from the base's options, groups included; nothing is
    read before setup (the root need not exist)."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    class Model(LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()

    monkeypatch.setattr(sys, "argv", ["train.py"])
    args = [
        f"--data.root={tmp_path / 'rects'}",
        "--data.batch_size=4",
        "--data.ignore_index=7",
        "--data.val=0.2",
        "--data.workers.num_workers=0",
        "--data.workers.decode_threads=auto",
        "--data.image_size=32",
        "--trainer.logger=false",
    ]
    cli = LightningCLI(Model, member, args=args, run=False, save_config_callback=None)
    dm = cli.datamodule
    assert type(dm) is member and (dm.batch_size, dm.ignore_index, dm.val) == (4, 7, 0.2)
    assert dm.workers == WorkerSettings(num_workers=0, decode_threads="auto")
    assert dm.roots == [str(tmp_path / "rects")] and dm.image_size == 32
