"""DDP evaluation: every val/test sample counted once across ranks; 2-process accuracy == 1-process.

The val (45) and test (37) splits are not multiples of 2 ranks x batch 8, so on 2 ranks the plan
pads each with one repeat labelled `PAD_LABEL` (-100, rule 3 of `fastdata.read.plan`). The model
is fixed: nearest-template matching whose templates are the even samples of each split, as
the data module hands them over; its accuracy is exactly (even samples) / (samples), and a padding
sample counted as real (it repeats sample 0, which the model gets right) would change it. Accuracy
is computed as the README tells users to: correct and total counts over ``y != -100``, logged with
``sync_dist=True, reduce_fx="sum"``; torchmetrics' accuracy with ``ignore_index=-100`` must agree.
Labels equal sample ids, so the labels each rank evaluated name the samples. Run on the cpu and
memory backends (`trainer.validate` and `trainer.test`, 1 process, then 2 DDP processes on gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from fastdata import ShardDataModule, WorkerSettings
from fastdata.read.plan import PAD_LABEL
from fastdata.train.ddp import end_process_group

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"train": 16, "val": 45, "test": 37}
BATCH = 8
SIDE = 4

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- evaluation script
def _datamodule(shards: Path, backend: str = "cpu") -> ShardDataModule:
    return ShardDataModule(
        shards,
        batch_size=BATCH,
        backend=backend,
        train_transforms="none",
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )


class _NearestTemplate(pl.LightningModule):
    """Predicts the template nearest to the input; records each rank's labels per batch."""

    def __init__(self, templates: dict[str, torch.Tensor], out: Path) -> None:
        super().__init__()
        self.out = out
        self.weights = nn.ParameterDict()
        self.biases = nn.ParameterDict()
        for split, t in templates.items():
            # argmax(x.t - |t|^2 / 2) = argmin |x - t|; a class without a template never wins.
            bias = torch.where(t.abs().sum(1) > 0, -0.5 * (t * t).sum(1), torch.tensor(-1e9))
            self.weights[split] = nn.Parameter(t, requires_grad=False)
            self.biases[split] = nn.Parameter(bias, requires_grad=False)
        from torchmetrics.classification import MulticlassAccuracy

        classes = max(len(t) for t in templates.values())
        self.accuracy = nn.ModuleDict(
            {
                s: MulticlassAccuracy(classes, average="micro", ignore_index=PAD_LABEL)
                for s in templates
            }
        )

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], split: str) -> None:
        x, y = batch
        logits = x.flatten(1) @ self.weights[split].T + self.biases[split]
        pred = logits.argmax(1)
        real = y != PAD_LABEL  # padding samples: counted on no rank
        n = len(y)
        # The README's recipe: sum correct and total counts over batches and ranks.
        self.log(
            f"{split}_correct",
            (pred == y)[real].sum().float(),
            sync_dist=True,
            reduce_fx="sum",
            batch_size=n,
        )
        self.log(
            f"{split}_total", real.sum().float(), sync_dist=True, reduce_fx="sum", batch_size=n
        )
        self.accuracy[split](pred, y)
        self.log(f"{split}_acc_torchmetrics", self.accuracy[split], batch_size=n)
        with open(self.out / f"{split}-rank{self.global_rank}.txt", "a") as f:
            f.write(" ".join(map(str, y.tolist())) + "\n")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")


def evaluate(shards: Path, out: Path, devices: int, backend: str) -> None:
    """`trainer.validate` then `trainer.test` on `devices` CPU processes; rank results to out/."""
    templates = torch.load(out.parent / "templates.pt")
    model = _NearestTemplate(templates, out)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    results = {}
    for run in (trainer.validate, trainer.test):
        (metrics,) = run(model, datamodule=_datamodule(shards, backend))
        results.update({k: float(v) for k, v in metrics.items()})
    (out / f"metrics-rank{trainer.global_rank}.json").write_text(json.dumps(results))


# ----------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.arrays import ArraySource

    rng = np.random.default_rng(5)
    arrays = {
        split: (rng.integers(0, 256, (n, SIDE, SIDE, 3), dtype=np.uint8), np.arange(n))
        for split, n in SIZES.items()
    }
    source = ArraySource(arrays, [f"s{i}" for i in range(max(SIZES.values()))])
    out = tmp_path_factory.mktemp("ddp-eval") / "shards"
    write_shards(source, out, ShardOptions(max_count=16, workers=1, progress=False))
    return out


def _templates(shards: Path) -> dict[str, torch.Tensor]:
    """Per split, the even samples' inputs as the model sees them (zero rows for odd ids)."""
    dm = _datamodule(shards)
    dm.setup("validate")
    templates = {}
    for split, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
        rows = torch.zeros(SIZES[split], 3 * SIDE * SIDE)
        for batch in loader:
            x, y = dm.on_after_batch_transfer(batch, 0)
            even = y % 2 == 0
            rows[y[even]] = x.flatten(1)[even].float()
        templates[split] = rows
    return templates


def _run(shards: Path, out: Path, devices: int, backend: str) -> dict[str, float]:
    out.mkdir()
    if devices == 1:
        evaluate(shards, out, 1, backend)
    else:  # Lightning's DDP launcher re-runs this file once per extra rank
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, __file__, str(shards), str(out), str(devices), backend]
        done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "sync_dist" not in done.stderr, "epoch metrics must be reduced across ranks"
    ranks = [json.loads((out / f"metrics-rank{r}.json").read_text()) for r in range(devices)]
    assert all(r == ranks[0] for r in ranks), f"ranks disagree on the metrics: {ranks}"
    return ranks[0]


def _labels(out: Path, split: str, rank: int) -> list[list[int]]:
    lines = (out / f"{split}-rank{rank}.txt").read_text().splitlines()
    return [list(map(int, line.split())) for line in lines]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("memory", marks=pytest.mark.heavy)])
def test_two_process_accuracy_equals_one_process_and_each_sample_counts_once(
    shards: Path, tmp_path: Path, backend: str
) -> None:
    torch.save(_templates(shards), tmp_path / "templates.pt")
    one = _run(shards, tmp_path / "one", 1, backend)
    two = _run(shards, tmp_path / "two", 2, backend)
    for split, n in (("val", SIZES["val"]), ("test", SIZES["test"])):
        expected = Fraction((n + 1) // 2, n)  # the even ids have templates
        for metrics in (one, two):
            assert metrics[f"{split}_total"] == n
            assert Fraction(int(metrics[f"{split}_correct"]), n) == expected
            assert metrics[f"{split}_acc_torchmetrics"] == pytest.approx(float(expected), abs=1e-6)

        ranks = [_labels(tmp_path / "two", split, r) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]), "ranks ran different numbers of batches"
        assert [len(b) for b in ranks[0]] == [len(b) for b in ranks[1]]
        labels = [y for rank in ranks for batch in rank for y in batch]
        counts = Counter(y for y in labels if y != PAD_LABEL)
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}
        assert labels.count(PAD_LABEL) == (-n) % 2  # the plan pads to a multiple of the ranks
        single = [y for batch in _labels(tmp_path / "one", split, 0) for y in batch]
        assert sorted(single) == list(range(n)), "one process: each sample once, no padding"
        # Rule 2: a step is rank 0's batch then rank 1's; the steps are the one-process order.
        steps = [y for b0, b1 in zip(*ranks, strict=True) for y in b0 + b1]
        assert steps == single + [PAD_LABEL] * ((-n) % 2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One evaluation run of this test (DDP entry).")
    parser.add_argument("shards", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("devices", type=int)
    parser.add_argument("backend")
    args = parser.parse_args()
    evaluate(args.shards, args.out, args.devices, args.backend)
    end_process_group()
