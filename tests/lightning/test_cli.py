"""LightningCLI (both packages) builds ShardDataModule from command-line arguments and fits."""

from __future__ import annotations

import json
import sys

import pytest

from fastdata import ShardDataModule
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
        "--data.num_workers=0",
        "--data.prefetch_factor=2",
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
