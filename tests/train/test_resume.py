"""Kill a training run with SIGKILL, resume it from last.ckpt: every sample is trained on exactly once.

The shards hold one sample per label (label == sample id). The training script (this file, run
as ``python test_resume.py ...``) appends the labels of every step, with the step index, to a
record file and flushes it. A callback SIGKILLs the process at the start of a chosen step; the
second run resumes with ``fit(ckpt_path="last")``. Steps the first run recorded at or after the
checkpoint's global step were lost with the kill, so they do not count; what remains, together
with the second run, must be every sample once per epoch, in the same order as a run never killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdata import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES, BATCH, EPOCHS, EVERY = (
    48,
    4,
    2,
    4,
)  # 12 batches per epoch, checkpoints at steps 4, 8, 12, ...
STEPS_PER_EPOCH = NUM_SAMPLES // BATCH

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- training script
class _Recording(pl.LightningModule):
    def __init__(self, record: Path) -> None:
        super().__init__()
        self.net = nn.Linear(4 * 4 * 3, NUM_SAMPLES)
        self.record = record

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        with open(self.record, "a") as f:  # appended and flushed per step: survives SIGKILL
            f.write(f"{self.global_step} {self.current_epoch} {' '.join(map(str, y.tolist()))}\n")
        return F.cross_entropy(self.net(x.flatten(1).float()), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _train(args: argparse.Namespace) -> None:
    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.train import TrainPreset, make_trainer

    dm = ShardDataModule(
        args.shards,
        batch_size=BATCH,
        backend=args.backend,
        train_transforms="none",
        seed=3,
        workers=WorkerSettings(num_workers=args.workers, prefetch_factor=2),
    )
    trainer = make_trainer(
        TrainPreset(precision="32-true", checkpoint_dir=args.ckpt, checkpoint_every_n_steps=EVERY),
        max_epochs=EPOCHS,
        callbacks=[_KillAt(args.kill_at)] if args.kill_at >= 0 else [],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Recording(args.record), datamodule=dm, ckpt_path="last" if args.resume else None)


# ----------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("fastdata.lightning.datamodule", reason="ShardDataModule is not there yet")
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources.arrays import ArraySource

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (NUM_SAMPLES, 4, 4, 3), dtype=np.uint8)
    labels = np.arange(NUM_SAMPLES)  # label == sample id
    source = ArraySource(
        {"train": (pixels, labels), "test": (pixels[:8], labels[:8])},
        classes=[f"s{i}" for i in labels],
    )
    out = tmp_path_factory.mktemp("resume") / "shards"
    write_shards(source, out, ShardOptions(max_count=10, workers=1, progress=False))
    return out


def _run(shards: Path, work: Path, backend: str, kill_at: int = -1, resume: bool = False) -> int:
    workers = 1 if backend == "cpu" else 0
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        "timeout",
        "-k",
        "10",
        "180",
        sys.executable,
        __file__,
        "--shards",
        str(shards),
        "--ckpt",
        str(work / "ckpt"),
        "--record",
        str(work / "record.txt"),
        "--backend",
        backend,
        "--workers",
        str(workers),
        "--kill-at",
        str(kill_at),
    ] + (["--resume"] if resume else [])
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode not in (0, -signal.SIGKILL):
        pytest.fail(
            f"training exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done.returncode


def _records(path: Path) -> list[tuple[int, int, list[int]]]:
    rows = []
    for line in path.read_text().splitlines():
        step, epoch, *labels = map(int, line.split())
        rows.append((step, epoch, labels))
    return rows


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list]:
    """backend -> records of a run never killed (computed on first use)."""
    cache: dict[str, list] = {}

    def get(backend: str) -> list:
        if backend not in cache:
            work = tmp_path_factory.mktemp(f"reference-{backend}")
            assert _run(shards, work, backend) == 0
            cache[backend] = _records(work / "record.txt")
        return cache[backend]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "kill_at"),
    [
        ("cpu", 7),  # mid-epoch 0: resumes at step 4
        (
            "cpu",
            14,
        ),  # early in epoch 1: resumes from the checkpoint taken at the epoch's last batch
        pytest.param("cpu", 19, marks=pytest.mark.heavy),  # mid-epoch 1: resumes at step 16
        pytest.param("memory", 7, marks=pytest.mark.heavy),  # cpu-7 killed the same way
    ],
)
def test_killed_run_resumes_every_sample_exactly_once(
    shards: Path, reference: Callable[[str], list], tmp_path: Path, backend: str, kill_at: int
) -> None:
    assert _run(shards, tmp_path, backend, kill_at=kill_at) == -signal.SIGKILL
    first = _records(tmp_path / "record.txt")
    assert first[-1][0] == kill_at - 1, "the kill did not happen at the chosen step"
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    resumed_from = ckpt["global_step"]
    assert resumed_from == (kill_at // EVERY) * EVERY

    (tmp_path / "record.txt").rename(tmp_path / "first.txt")
    assert _run(shards, tmp_path, backend, resume=True) == 0
    second = _records(tmp_path / "record.txt")
    assert second[0][0] == resumed_from
    kept = [row for row in first if row[0] < resumed_from] + second  # lost steps do not count

    assert [row[0] for row in kept] == list(range(EPOCHS * STEPS_PER_EPOCH))
    for epoch in range(EPOCHS):
        seen = sorted(label for _, e, labels in kept if e == epoch for label in labels)
        assert seen == list(range(NUM_SAMPLES)), f"epoch {epoch}: samples not seen exactly once"
    assert kept == reference(backend), (
        "the resumed run trained in another order than an uninterrupted one"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--shards", "--ckpt", "--record", "--backend"):
        parser.add_argument(name, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    _train(parser.parse_args())
    from fastdata.train.ddp import end_process_group

    end_process_group()
