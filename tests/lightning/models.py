"""Small LightningModules built on either Lightning package, for the tests in this folder."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

#: Both names Lightning is imported under: the Trainer of each must take a ShardDataModule.
PACKAGES = ("lightning.pytorch", "pytorch_lightning")

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def lightning_package(name: str) -> ModuleType:
    return importlib.import_module(name)


def small_cnn(pkg: ModuleType) -> type:
    """An ordinary classifier on `pkg.LightningModule` that records the labels it trained on.

    It reads its head size from `self.trainer.datamodule.num_classes` in `configure_model`, as
    modules written against a DataModule do.
    """

    class SmallCNN(pkg.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.lr = lr
            self.body = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
            )
            self.head: nn.Module | None = None
            self.seen: list[list[int]] = []  # training labels, one list per batch
            self.val_seen: list[list[int]] = []
            self.shapes: set[tuple[int, ...]] = set()

        def configure_model(self) -> None:
            if self.head is None:
                self.head = nn.Linear(8, self.trainer.datamodule.num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.append(y.tolist())
            self.shapes.add(tuple(x.shape[1:]))
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_seen.append(y.tolist())
            self.log("val_loss", nn.functional.cross_entropy(self(x), y))

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", nn.functional.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    return SmallCNN
