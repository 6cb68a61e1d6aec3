"""SegmentationDataModule and DetectionDataModule: `trainer.fit` of tiny pure-torch models for a few
steps (Lightning Trainer, CPU), and the refusal of a split without the task's target."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdata import DetectionDataModule, SegmentationDataModule, WorkerSettings
from fastdata.format.fields import FieldSpec
from fastdata.read.decoders.dict_batch import TrainSample
from tests.lightning.family.conftest import ALL_FIELDS, NUM_CLASSES, rectangles, write_field_shards


class TinySegmenter(pl.LightningModule):
    """Two convolutions to per-pixel class logits; cross-entropy ignoring padding pixels."""

    def __init__(self, ignore_index: int = 255) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, NUM_CLASSES + 1, 1)
        )
        self.ignore_index = ignore_index
        self.seen: list[str] = []

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, TrainSample) and batch["image"].dtype == torch.float32
        logits = self.net(batch["image"])
        self.seen += [m["key"] for m in batch["meta"]]
        return F.cross_entropy(logits, batch["mask"], ignore_index=self.ignore_index)

    def validation_step(self, batch, batch_idx):
        logits = self.net(batch["image"])
        loss = F.cross_entropy(logits, batch["mask"], ignore_index=self.ignore_index)
        self.log("val_loss", loss, batch_size=len(batch["image"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyDetector(pl.LightningModule):
    """A pooled feature to one box (sigmoid xyxy in image units) and class logits: L1 + CE
    against each image's first box (images whose rectangle was cropped away are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.box = nn.Linear(8, 4)
        self.cls = nn.Linear(8, NUM_CLASSES)

    def _loss(self, batch):
        x = batch["image"]
        h, w = x.shape[-2:]
        f = self.features(x).mean((2, 3))
        keep = [i for i, b in enumerate(batch["boxes"]) if len(b)]
        if not keep:
            return (f * 0).sum()
        target = torch.stack([batch["boxes"][i][0] for i in keep]) / torch.tensor([w, h, w, h])
        labels = torch.stack([batch["box_labels"][i][0] for i in keep])
        boxes = torch.sigmoid(self.box(f[keep]))
        return F.l1_loss(boxes, target) + F.cross_entropy(self.cls(f[keep]), labels)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), batch_size=len(batch["image"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=2,
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_fit_a_tiny_segmenter(rect_shards: Path, backend: str) -> None:
    dm = SegmentationDataModule(
        rect_shards,
        batch_size=8,
        backend=backend,
        image_size=24,
        workers=WorkerSettings(num_workers=0),
    )
    model = TinySegmenter()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer()
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 4 and len(model.seen) == 32
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_fit_a_tiny_detector(rect_shards: Path, backend: str) -> None:
    dm = DetectionDataModule(
        rect_shards, batch_size=8, backend=backend, workers=WorkerSettings(num_workers=0)
    )
    trainer = _trainer()
    trainer.fit(TinyDetector(), datamodule=dm)
    assert trainer.global_step == 4
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert dm.transforms.name == "detection" and dm.image_size == 224


@pytest.mark.parametrize(
    ("module", "drop", "target"),
    [(SegmentationDataModule, "mask", "'mask'"), (DetectionDataModule, "boxes", "'boxes'")],
)
def test_a_split_without_the_target_is_refused_saying_what_it_holds(
    tmp_path: Path, module, drop: str, target: str
) -> None:
    fields = {n: f for n, f in ALL_FIELDS.items() if n != drop}
    root = write_field_shards(tmp_path / "x", {"train": rectangles(8, 4)}, fields)
    dm = module(
        root, batch_size=4, workers=WorkerSettings(num_workers=0), backend="cpu", image_size=16
    )
    with pytest.raises(ValueError, match=f"needs a {target} field") as info:
        dm.setup("fit")
    assert "image (image)" in str(info.value) and "caption (text)" in str(info.value)


def test_a_classification_split_is_refused_by_the_segmentation_module(tiny_shards: Path) -> None:
    dm = SegmentationDataModule(
        tiny_shards, batch_size=4, backend="cpu", workers=WorkerSettings(num_workers=0)
    )
    with pytest.raises(
        ValueError,
        match=r"holds image \(image\), label \(label\)|holds label \(label\), image \(image\)",
    ):
        dm.setup("fit")
    assert FieldSpec  # the fields a split holds are FieldSpecs
