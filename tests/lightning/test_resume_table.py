"""The resume table of docs/guides/resume.md: a Lightning fit killed twice mid-epoch.

One run uses the Trainer features that break other loaders' resume all at once:
`limit_train_batches`, mid-epoch validation (`val_check_interval`), `configure_optimizers`
reading `trainer.estimated_stepping_batches` (OneCycleLR), `accumulate_grad_batches` and two
loader workers, over two epochs. It is SIGKILLed in epoch 0 and again in epoch 1, each time
resumed from the `ModelCheckpoint` file of the step before; the batches it trained on (the
killed runs' batches up to their checkpoint, then the resumed run's) must be the uninterrupted
run's, in order, every validation must see the whole val split once, and the final weights must
equal the uninterrupted run's. Labels name samples (`tests.conftest.unique_label_source`).

Also here: Fabric, which has no checkpoint of its own for the loader: `dm.state_dict()` saved
with `fabric.save` and loaded into a new DataModule continues the epoch exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NUM_TRAIN = 203
BATCH = 8
CKPT_EVERY = 2  # optimizer steps
KILLS = (5, 13)  # optimizer steps at which a run kills itself: epoch 0, then epoch 1

_SCRIPT = """
import json, os, signal, sys
from pathlib import Path
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from fastdata import ShardDataModule, WorkerSettings

shards, out, kill_at, ckpt = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
record = open(out / "record.txt", "a")


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8 * 8 * 3, 256)

    def training_step(self, batch, batch_idx):
        x, y = batch
        record.write(json.dumps(["train", self.global_step, y.tolist()]) + "\\n")
        record.flush()
        return F.cross_entropy(self.net(x.flatten(1).float()), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        record.write(json.dumps(["val", self.global_step, y.tolist()]) + "\\n")
        record.flush()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == kill_at:
            record.close()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self):
        torch.save(self.net.state_dict(), out / "weights.pt")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = int(self.trainer.estimated_stepping_batches)
        (out / "total_steps.txt").write_text(str(total))
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


dm = ShardDataModule(
    shards, batch_size=__BATCH__, backend="cpu", train_transforms="none", seed=3,
    splits={"val": "test"}, workers=WorkerSettings(num_workers=2, prefetch_factor=2),
)
checkpoint = ModelCheckpoint(
    dirpath=out.parent / "ckpt", filename="{step}", every_n_train_steps=__EVERY__,
    save_top_k=-1, save_last=True,
)
trainer = pl.Trainer(
    accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=0.75,
    val_check_interval=7, accumulate_grad_batches=2, num_sanity_val_steps=0,
    callbacks=[checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Model(), datamodule=dm, ckpt_path=None if ckpt == "-" else ckpt)
""".replace("__BATCH__", str(BATCH)).replace("__EVERY__", str(CKPT_EVERY))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastdata.write import ShardOptions, write_shards
    from tests.conftest import unique_label_source

    out = tmp_path_factory.mktemp("resume-table") / "shards"
    source = unique_label_source(n_train=NUM_TRAIN, n_test=19)
    write_shards(source, out, ShardOptions(max_count=40, workers=1, progress=False))
    return out


def _fit(script: Path, shards: Path, out: Path, kill_at: int, ckpt: Path | None) -> int:
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(script), str(shards), str(out), str(kill_at), str(ckpt or "-")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if kill_at < 0 and done.returncode != 0:
        pytest.fail(f"the fit failed:\n{done.stderr[-4000:]}")
    return done.returncode


def _records(out: Path) -> list[tuple[str, int, list[int]]]:
    return [tuple(json.loads(line)) for line in (out / "record.txt").read_text().splitlines()]


@pytest.mark.slow
def test_a_fit_killed_twice_trains_on_the_uninterrupted_runs_batches(shards, tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    _fit(script, shards, tmp_path / "reference", -1, None)
    reference = _records(tmp_path / "reference")

    ckpt = tmp_path / "ckpt"
    kept: list[tuple[str, int, list[int]]] = []
    resume_from: Path | None = None
    for number, kill_at in enumerate(KILLS):
        out = tmp_path / f"killed{number}"
        code = _fit(script, shards, out, kill_at, resume_from)
        assert code == -9, f"run {number} was to be killed at step {kill_at}, exit {code}"
        saved = kill_at - kill_at % CKPT_EVERY  # the last checkpoint before the kill
        resume_from = ckpt / f"step={saved}.ckpt"
        assert resume_from.exists(), sorted(p.name for p in ckpt.iterdir())
        kept += [row for row in _records(out) if row[1] < saved]  # what the checkpoint holds
    _fit(script, shards, tmp_path / "resumed", -1, resume_from)
    kept += _records(tmp_path / "resumed")

    train = [row for row in reference if row[0] == "train"]
    assert [row for row in kept if row[0] == "train"] == train
    assert len(train) == 2 * int(0.75 * (NUM_TRAIN // BATCH))  # limit_train_batches (drop_last)
    val_runs: dict[int, list[int]] = {}
    for kind, step, labels in kept:
        if kind == "val":
            val_runs.setdefault(step, []).extend(labels)
    assert val_runs, "no mid-epoch validation ran"
    for step, labels in val_runs.items():  # each validation saw the val split once
        assert sorted(label for label in labels if label >= 0) == list(range(19)), step
    totals = {
        (tmp_path / name / "total_steps.txt").read_text() for name in ("reference", "resumed")
    }
    assert len(totals) == 1  # estimated_stepping_batches is the same after the resumes
    weights = torch.load(tmp_path / "resumed" / "weights.pt")
    expected = torch.load(tmp_path / "reference" / "weights.pt")
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


def test_fabric_continues_the_epoch_from_a_saved_loader_state(tiny_shards, tmp_path):
    from lightning.fabric import Fabric

    from fastdata import ShardDataModule, WorkerSettings

    def module() -> ShardDataModule:
        dm = ShardDataModule(
            tiny_shards, batch_size=32, backend="cpu", workers=WorkerSettings(num_workers=0)
        )
        dm.setup("fit")
        return dm

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()

    def labels(dm: ShardDataModule, stop_after: int | None = None) -> list[list[int]]:
        seen = []
        for step, batch in enumerate(
            fabric.setup_dataloaders(dm.train_dataloader().as_dataloader())
        ):
            _x, y = dm.on_after_batch_transfer(batch, 0)  # counts the step, as in the guide
            seen.append(y.tolist())
            if step == stop_after:
                break
        return seen

    whole = labels(module())
    dm = module()
    first = labels(dm, stop_after=3)
    fabric.save(tmp_path / "state.ckpt", {"data": dm.state_dict()})
    again = module()
    again.load_state_dict(fabric.load(tmp_path / "state.ckpt")["data"])
    assert first + labels(again) == whole
