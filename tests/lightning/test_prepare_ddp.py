"""`ShardDataModule(source=...)` under DDP: the shards are written once, whoever calls prepare_data.

Three layouts, each a real `Trainer.fit` on gloo over loopback: one node with 2 processes
(Lightning's launcher starts the second by re-running this file), and two "nodes" of one process
each (two processes with NODE_RANK 0 and 1, as a cluster's launcher starts them) sharing one shard
folder, with ``prepare_data_per_node`` True (both nodes' local rank 0 shard at once: the folder's
lock lets one write, the other then finds its manifest) and False (global rank 0 alone shards;
the other node waits at Lightning's barrier, then for the manifest). The writer's test hooks
(`FASTDATA_TEST_HOOKS`) log every shard written, in whatever process: each must appear once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from fastdata import ShardDataModule, ShardOptions, ShardSource, WorkerSettings
from fastdata.train.ddp import end_process_group
from tests.conftest import write_jpeg_folder

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- fit script
class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))
        self.labels: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.labels += y.tolist()
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(images: Path, shards: Path, out: Path, devices: int, nodes: int, per_node: bool) -> None:
    options = ShardOptions(max_count=4, workers=1)  # progress: on global rank 0 only
    dm = ShardDataModule(
        shards,
        source=ShardSource("folder", str(images), options=options, timeout=120),
        batch_size=2,
        backend="cpu",
        image_size=16,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    dm.prepare_data_per_node = per_node
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy="ddp", max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    model = _Tiny()
    trainer.fit(model, datamodule=dm)
    result = {"labels": model.labels, "samples": dm.manifest.split("train").num_samples}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------- test side
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(args: list[str], cwd: Path, hooks: Path, **env: str) -> subprocess.Popen:
    environ = {
        **os.environ,
        **env,
        "FASTDATA_TEST_HOOKS": str(hooks),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, __file__, *args]
    return subprocess.Popen(cmd, cwd=cwd, env=environ, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    ("devices", "nodes", "per_node"),
    [(2, 1, True), (1, 2, True), (1, 2, False)],
    ids=["one-node-2-processes", "two-nodes-per-node", "two-nodes-once-in-all"],
)
def test_ddp_ranks_write_the_shards_once(tmp_path: Path, devices: int, nodes: int, per_node: bool):
    images = write_jpeg_folder(tmp_path / "images", classes=3, per_class=4, size=(24, 20))
    shards, out, hooks = tmp_path / "shards", tmp_path / "out", tmp_path / "hooks"
    out.mkdir()
    hooks.mkdir()
    (hooks / "delay").write_text("0.3")  # a sharding long enough for the other node to meet it
    args = [str(images), str(shards), str(out), str(devices), str(nodes), str(int(per_node))]
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [_start(args, out, hooks, NODE_RANK=str(n), **master) for n in range(nodes)]
    try:
        errors = [proc.communicate(timeout=240)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-4000:]
    written = (hooks / "written.log").read_text().split()
    assert sorted(written) == ["train-000000", "train-000001", "train-000002"]  # each once
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices * nodes)]
    assert all(r["samples"] == 12 for r in ranks)
    seen = sorted(y for r in ranks for y in r["labels"])
    assert seen == sorted([0] * 4 + [1] * 4 + [2] * 4)  # the epoch, split across the ranks
    shown = sum("sharding ->" in err for err in errors)
    assert shown <= 1  # the progress bar on global rank 0 only (none when node 1 wrote)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One fit of this test (DDP entry).")
    for name in ("images", "shards", "out"):
        parser.add_argument(name, type=Path)
    for name in ("devices", "nodes", "per_node"):
        parser.add_argument(name, type=int)
    a = parser.parse_args()
    fit(a.images, a.shards, a.out, a.devices, a.nodes, bool(a.per_node))
    end_process_group()
