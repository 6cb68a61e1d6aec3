"""2-process evaluation of a segmentation and a detection split equals 1-process: the same
per-sample outputs, each sample once (padding samples marked and skipped), on the cpu and memory
backends (`trainer.validate`, then 2 DDP processes on gloo, as tests/lightning/test_ddp_eval.py does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from fastdata import DetectionDataModule, SegmentationDataModule, WorkerSettings

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


class _Record(pl.LightningModule):
    """Writes each real sample's outputs (mask pixels per class, boxes, image sum) per rank."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.dummy = nn.Parameter(torch.zeros(1))

    def validation_step(self, batch, batch_idx) -> None:
        rows = []
        for i, meta in enumerate(batch["meta"]):
            if batch["padded"][i]:
                assert not len(batch["boxes"][i]) if "boxes" in batch else True
                continue
            row = {"key": meta["key"], "image": round(float(batch["image"][i].sum()), 2)}
            if "mask" in batch:
                row["mask"] = torch.bincount(batch["mask"][i].flatten(), minlength=256).tolist()
            if "boxes" in batch:
                row["boxes"] = [[round(v, 3) for v in b] for b in batch["boxes"][i].tolist()]
            rows.append(row)
        with open(self.out / f"rank{self.global_rank}.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def evaluate(shards: Path, out: Path, devices: int, backend: str, task: str) -> None:
    module = SegmentationDataModule if task == "segmentation" else DetectionDataModule
    dm = module(
        shards, batch_size=4, workers=WorkerSettings(num_workers=0), backend=backend, image_size=20
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(_Record(out), datamodule=dm)


def _run(shards: Path, out: Path, devices: int, backend: str, task: str) -> dict[str, dict]:
    out.mkdir()
    if devices == 1:
        evaluate(shards, out, 1, backend, task)
    else:  # Lightning's DDP launcher re-runs this file once per extra rank
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, __file__, str(shards), str(out), str(devices), backend, task]
        done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    rows = [
        json.loads(line)
        for r in range(devices)
        for line in (out / f"rank{r}.jsonl").read_text().splitlines()
    ]
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)), "a sample was evaluated twice"
    return {r["key"]: r for r in rows}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("memory", marks=pytest.mark.heavy)])
def test_two_process_evaluation_equals_one_process(rect_shards, rect_splits, tmp_path, backend):
    expected = sorted(r.key for r in rect_splits["val"])  # 13: padded to 2 ranks x 4 x 2 steps
    for task in ("segmentation", "detection"):
        one = _run(rect_shards, tmp_path / f"{task}-one", 1, backend, task)
        two = _run(rect_shards, tmp_path / f"{task}-two", 2, backend, task)
        assert sorted(one) == expected and sorted(two) == expected
        assert one == two


if __name__ == "__main__":
    from fastdata.train.ddp import end_process_group

    shards_arg, out_arg, devices_arg, backend_arg, task_arg = sys.argv[1:6]
    try:
        evaluate(Path(shards_arg), Path(out_arg), int(devices_arg), backend_arg, task_arg)
    finally:
        end_process_group()
