"""A tutorial-style `pytorch_lightning` ResNet module trains on CIFAR-100 shards, fit then test.

`LitResnet` below is written after Lightning's "PyTorch Lightning CIFAR10 ~94% Baseline Tutorial"
(github.com/Lightning-AI/tutorials, lightning_examples/cifar10-baseline/baseline.py, Apache-2.0):
the same Lightning surface, rewritten here rather than copied: `from pytorch_lightning import
LightningModule, Trainer, seed_everything`, `save_hyperparameters` / `self.hparams.lr`, log-softmax
+ NLL, torchmetrics' functional accuracy, one `evaluate` shared by validation and test, SGD with a
per-step OneCycleLR sized from `self.trainer`, `LearningRateMonitor`, `trainer.fit(model, dm)`
then `trainer.test`. Changes a user makes for fastdata, and none other: `ShardDataModule` replaces
the CIFAR-10 loaders and `num_classes` comes from `dm.num_classes`. CI has no torchvision (it
cannot be installed beside the CPU torch), so `resnet18` is a small pure-torch stand-in with
torchvision's ResNet-18 layout (`torchvision.models.resnet`, BSD-3-Clause): the same stem and
attribute names (`conv1`, `maxpool`, `fc`) and two BasicBlocks per stage, at a quarter of the
width so that a few steps take seconds on a CPU.
"""

from __future__ import annotations

import csv
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import OneCycleLR

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torchmetrics")

from fastdata_pipelines.env import data_dir  # noqa: E402
from pytorch_lightning import LightningModule, Trainer, seed_everything  # noqa: E402
from pytorch_lightning.callbacks import LearningRateMonitor  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402
from torchmetrics.functional import accuracy  # noqa: E402

from fastdata import ShardDataModule, WorkerSettings  # noqa: E402
from fastdata.write import ShardOptions, write_shards  # noqa: E402
from fastdata.write.sources.arrays import ArraySource  # noqa: E402

BATCH_SIZE = 64
NUM_CLASSES = 10  # set from dm.num_classes by the test, as a user would


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class _ResNet(nn.Module):
    def __init__(self, num_classes: int, widths: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], widths[0]
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(
                nn.Sequential(_BasicBlock(cin, width, stride), _BasicBlock(width, width, 1))
            )
            cin = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(pretrained: bool = False, num_classes: int = 1000) -> _ResNet:
    """Stand-in for `torchvision.models.resnet18` (see the module docstring)."""
    assert not pretrained
    return _ResNet(num_classes)


def create_model() -> nn.Module:
    """The tutorial's CIFAR adaptation: a 3x3 stride-1 stem and no max-pool for 32x32 inputs."""
    model = resnet18(pretrained=False, num_classes=NUM_CLASSES)
    model.conv1 = nn.Conv2d(3, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
    model.maxpool = nn.Identity()
    return model


class LitResnet(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model(x), dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def evaluate(self, batch, stage=None):
        x, y = batch
        log_probs = self(x)
        loss = F.nll_loss(log_probs, y)
        acc = accuracy(log_probs.argmax(dim=1), y, task="multiclass", num_classes=NUM_CLASSES)
        if stage:
            self.log(f"{stage}_loss", loss, prog_bar=True)
            self.log(f"{stage}_acc", acc, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        self.evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self.evaluate(batch, "test")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4
        )
        schedule = OneCycleLR(optimizer, 0.1, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _cifar100_arrays(archive: Path, n_train: int, n_test: int) -> ArraySource:
    """The first images of the real CIFAR-100 archive's train and test sets (fine labels)."""
    splits = {}
    with tarfile.open(archive) as tar:

        def rows(member: str) -> dict:
            return pickle.load(io.BytesIO(tar.extractfile(member).read()), encoding="latin1")

        classes = rows("cifar-100-python/meta")["fine_label_names"]
        for split, n in (("train", n_train), ("test", n_test)):
            data = rows(f"cifar-100-python/{split}")
            pixels = np.asarray(data["data"][:n], np.uint8).reshape(-1, 3, 32, 32)
            splits[split] = (
                pixels.transpose(0, 2, 3, 1).copy(),
                np.asarray(data["fine_labels"][:n]),
            )
    return ArraySource(splits, classes, kind="cifar100")


def _cifar_like_arrays(n_train: int, n_test: int) -> ArraySource:
    """A synthetic 32x32, 100-class stand-in, only where the real archive is absent."""
    rng = np.random.default_rng(7)
    splits = {
        split: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 100, n))
        for split, n in (("train", n_train), ("test", n_test))
    }
    return ArraySource(splits, [f"class{i}" for i in range(100)], kind="cifar100")


@pytest.fixture
def cifar100_shards(tmp_path: Path) -> Path:
    archive = data_dir() / "cifar-100-python.tar.gz"
    if archive.exists():
        source = _cifar100_arrays(archive, n_train=512, n_test=128)
    else:
        source = _cifar_like_arrays(n_train=512, n_test=128)
    out = tmp_path / "cifar100"
    write_shards(source, out, ShardOptions(max_count=256, workers=1, progress=False))
    return out


def test_tutorial_style_pytorch_lightning_module_fits_and_tests(
    cifar100_shards, tmp_path, monkeypatch
):
    seed_everything(7)
    dm = ShardDataModule(
        cifar100_shards,
        batch_size=BATCH_SIZE,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
        backend="cpu",
        splits={"val": "test"},  # the tutorial validates on a held-out split
    )
    monkeypatch.setitem(globals(), "NUM_CLASSES", dm.num_classes)
    assert dm.num_classes == 100 and dm.image_shape == (3, 32, 32)

    model = LitResnet(lr=0.05)
    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(save_dir=tmp_path / "logs"),
        callbacks=[LearningRateMonitor(logging_interval="step")],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, dm)
    assert np.isfinite(trainer.callback_metrics["val_loss"].item())
    results = trainer.test(model, datamodule=dm, verbose=False)

    assert model.model.fc.out_features == 100 and trainer.global_step == 4
    assert 0.0 <= results[0]["test_acc"] <= 1.0 and np.isfinite(results[0]["test_loss"])
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    rates = [float(row["lr-SGD"]) for row in logged if row.get("lr-SGD")]
    assert len(rates) == 4 and rates[0] < max(rates)  # OneCycleLR warms up over the 4 steps
