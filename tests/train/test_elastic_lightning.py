"""Elastic resume through Lightning's own checkpoints: 2 ranks x batch 10 <-> 1 rank x batch 20.

The shards hold one sample per label (label == sample id, `tests.conftest.unique_label_source`),
so the labels a model trains on name the samples. A first run (real DDP on CPU/gloo, processes
started by Lightning's launcher from this file, or one process) saves a checkpoint after K
steps with `ModelCheckpoint(every_n_train_steps=K)` and trains on for two more steps, which must
not count as consumed. A second run with another world size and per-rank batch size resumes
with ``trainer.fit(..., ckpt_path=<the step-K checkpoint>)``. The first run's steps before K plus
the resumed steps must be the whole epoch, each sample once, plus the padding of plan rule 3
(the remainder padded to a multiple of the new world size), in the order of a run never
interrupted; also for a checkpoint Lightning saves when a mid-epoch validation ends. A checkpoint
taken with another seed or on other shards is refused with `fastdata.read.resume.ResumeError`.
Lightning does not warn that the loader cannot resume, and the epochs after a resume with another
world size x batch size are whole (both were bugs this file found).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from fastdata import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 121  # odd: resuming on 2 ranks pads the remainder with one repeat
STEPS = 3  # the checkpoint's step (K)
SEED = 7

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- training script
class _Recording(pl.LightningModule):
    """Appends `global_step epoch label label ...` of every training batch to out/rank<r>.txt."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.net = nn.Linear(8 * 8 * 3, NUM_SAMPLES)
        self.out = out

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        with open(self.out / f"rank{self.global_rank}.txt", "a") as f:
            labels = " ".join(map(str, y.tolist()))
            f.write(f"{self.global_step} {self.current_epoch} {labels}\n")
        return F.cross_entropy(self.net(x.flatten(1).float()), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        real = y >= 0  # evaluation padding is labelled -100
        self.log("val_seen", real.sum().float(), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def train(
    shards: Path,
    out: Path,
    devices: int,
    batch_size: int,
    *,
    seed: int = SEED,
    max_steps: int = -1,
    ckpt_path: Path | None = None,
    validate: bool = False,
    epochs: int = 1,
) -> None:
    """`epochs` epochs, checkpointed into out/ckpt every STEPS steps (resumes from ckpt_path).

    validate: validate every STEPS steps instead, and checkpoint when validation ends (Lightning
    then saves from `on_validation_end`, in the middle of the training epoch).
    """
    from fastdata import ShardDataModule

    dm = ShardDataModule(
        shards,
        batch_size=batch_size,
        backend="cpu",
        train_transforms="none",
        seed=seed,
        drop_last=False,
        splits={"val": "test"},
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", filename="{step}", every_n_train_steps=None if validate else STEPS,
        save_top_k=-1, save_last=True,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_epochs=epochs, max_steps=max_steps, callbacks=[checkpoint], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=None if validate else 0, val_check_interval=STEPS if validate else None,
    )  # fmt: skip
    trainer.fit(_Recording(out), datamodule=dm, ckpt_path=ckpt_path)


# ----------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastdata.write import ShardOptions, write_shards
    from tests.conftest import unique_label_source

    out = tmp_path_factory.mktemp("elastic") / "shards"
    source = unique_label_source(n_train=NUM_SAMPLES, n_test=8)
    write_shards(source, out, ShardOptions(max_count=32, workers=1, progress=False))
    return out


def _run(shards: Path, out: Path, devices: int, batch_size: int, **kw: object) -> None:
    """`train` in this process (1 device) or in DDP processes Lightning starts from this file."""
    out.mkdir(parents=True, exist_ok=True)
    if devices == 1:
        train(shards, out, devices, batch_size, **kw)
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, __file__, str(shards), str(out), str(devices), str(batch_size)]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag] if value else []
        elif value is not None:
            cmd.append(f"{flag}={value}")
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        pytest.fail(f"{cmd} exited with {done.returncode}:\n{done.stderr[-4000:]}")


def _steps(out: Path, epoch: int = 0) -> dict[int, list[tuple[int, list[int]]]]:
    """rank -> [(global step, labels), ...] of `epoch`, as recorded by `_Recording`."""
    records = {}
    for path in sorted(out.glob("rank*.txt")):
        rows = [list(map(int, line.split())) for line in path.read_text().splitlines()]
        records[int(path.stem[4:])] = [(row[0], row[2:]) for row in rows if row[1] == epoch]
    return records


def _checkpoint_at_step(out: Path, step: int) -> Path:
    path = out / "ckpt" / f"step={step}.ckpt"
    assert path.exists(), f"no checkpoint at step {step}: {sorted((out / 'ckpt').iterdir())}"
    return path


def _in_step_order(out: Path, epoch: int = 0) -> list[tuple[int, list[int]]]:
    """(global step, labels of every rank in rank order) per step: the epoch order, rule 2."""
    by_rank = _steps(out, epoch)
    steps = sorted({row[0] for rows in by_rank.values() for row in rows})
    for rank, rows in by_rank.items():
        assert [row[0] for row in rows] == steps, f"rank {rank} ran other steps: {rows}"
    return [
        (step, [y for r in sorted(by_rank) for y in by_rank[r][i][1]])
        for i, step in enumerate(steps)
    ]


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """The labels of an uninterrupted 1 x 20 epoch, in training order."""
    out = tmp_path_factory.mktemp("reference")
    _run(shards, out, 1, 20)
    return [y for _, labels in _in_step_order(out) for y in labels]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after", "validate"),
    [
        ((2, 10), (1, 20), False),
        # 1 -> 2 ranks: the same resume code as 2 -> 1; ~40 s, left to the full run
        pytest.param((1, 20), (2, 10), False, marks=pytest.mark.heavy),
        ((2, 10), (1, 20), True),  # saved when a mid-epoch validation ends
    ],
)
def test_lightning_checkpoint_resumes_the_epoch_on_another_world_size(
    shards: Path,
    reference: list[int],
    tmp_path: Path,
    before: tuple[int, int],
    after: tuple[int, int],
    validate: bool,
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    # Two steps past the checkpoint: trained on, but lost for the resumed run.
    _run(shards, first, *before, max_steps=STEPS + 2, validate=validate)
    ckpt = _checkpoint_at_step(first, STEPS)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    world, batch = before
    assert saved["global_step"] == STEPS
    state = saved["ShardDataModule"]
    assert (state["consumed"], state["steps"], state["world_size"]) == (
        STEPS * world * batch, STEPS, world,
    )  # fmt: skip
    steps = _in_step_order(first)
    assert [step for step, _ in steps] == list(range(STEPS + 2))
    consumed = [y for step, labels in steps if step < STEPS for y in labels]

    _run(shards, second, *after, ckpt_path=ckpt, validate=validate)
    new_world, new_batch = after
    assert sorted(_steps(second)) == list(range(new_world))
    remaining = NUM_SAMPLES - len(consumed)
    padded = -(-remaining // new_world) * new_world  # rule 3: a multiple of the world size
    steps_left = -(-padded // (new_world * new_batch))
    resumed_steps = _in_step_order(second)
    assert [step for step, _ in resumed_steps] == list(range(STEPS, STEPS + steps_left))
    resumed = [y for _, labels in resumed_steps for y in labels]

    counts = Counter(consumed + resumed)
    assert sorted(counts) == list(range(NUM_SAMPLES)), "samples lost across the resume"
    repeats = sum(counts.values()) - NUM_SAMPLES
    assert repeats == padded - remaining, f"{repeats} repeats; rule 3 pads {padded - remaining}"
    assert not set(consumed) & set(resumed), "a sample consumed before the checkpoint came again"
    # The same epoch order as a run never interrupted; padding repeats the remainder's first.
    pad = reference[len(consumed) : len(consumed) + padded - remaining]
    assert consumed + resumed == reference + pad


def test_resuming_with_another_seed_or_other_shards_is_refused(
    shards: Path, tmp_path: Path
) -> None:
    from fastdata.read.resume import ResumeError
    from fastdata.write import ShardOptions, write_shards
    from tests.conftest import unique_label_source

    _run(shards, tmp_path / "first", 1, 20, max_steps=STEPS)
    ckpt = _checkpoint_at_step(tmp_path / "first", STEPS)
    with pytest.raises(ResumeError, match=f"seed={SEED}.*pass seed={SEED}"):
        _run(shards, tmp_path / "seed", 1, 20, seed=SEED + 1, ckpt_path=ckpt)
    # The same samples cut into other shards: another fingerprint, the same sample count.
    other = tmp_path / "other"
    source = unique_label_source(n_train=NUM_SAMPLES, n_test=8)
    write_shards(source, other, ShardOptions(max_count=40, workers=1, progress=False))
    with pytest.raises(ResumeError, match="another dataset.*resume with the shard folder"):
        _run(other, tmp_path / "dataset", 1, 20, ckpt_path=ckpt)
    assert not (tmp_path / "seed" / "rank0.txt").exists(), "trained before refusing the state"
    assert not (tmp_path / "dataset" / "rank0.txt").exists(), "trained before refusing the state"


def test_lightning_does_not_warn_that_the_loader_cannot_resume(
    shards: Path, tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    _run(shards, tmp_path / "first", 1, 20, max_steps=STEPS)
    recwarn.clear()
    _run(
        shards, tmp_path / "second", 1, 20, ckpt_path=_checkpoint_at_step(tmp_path / "first", STEPS)
    )
    assert len(_in_step_order(tmp_path / "second")) > 0
    messages = [str(w.message) for w in recwarn]
    assert not [m for m in messages if "not resumable" in m], messages


def test_epochs_after_a_resume_with_another_global_batch_are_whole(
    shards: Path, tmp_path: Path
) -> None:
    # 1 x 20 -> 1 x 10: the resumed epoch 0 has 3 + 7 batches, a whole epoch 13.
    _run(shards, tmp_path / "first", 1, 20, max_steps=STEPS)
    ckpt = _checkpoint_at_step(tmp_path / "first", STEPS)
    _run(shards, tmp_path / "second", 1, 10, ckpt_path=ckpt, epochs=2)
    epoch0 = [y for _, labels in _in_step_order(tmp_path / "second", 0) for y in labels]
    assert len(epoch0) == NUM_SAMPLES - STEPS * 20
    epoch1 = [y for _, labels in _in_step_order(tmp_path / "second", 1) for y in labels]
    assert sorted(epoch1) == list(range(NUM_SAMPLES)), (
        f"the epoch after the resume trained on {len(epoch1)} of {NUM_SAMPLES} samples"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One training run of this test (DDP entry).")
    parser.add_argument("shards", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("devices", type=int)
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--ckpt-path", type=Path, default=None)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    train(
        args.shards, args.out, args.devices, args.batch_size, seed=args.seed,
        max_steps=args.max_steps, ckpt_path=args.ckpt_path, validate=args.validate,
        epochs=args.epochs,
    )  # fmt: skip
    from fastdata.train.ddp import end_process_group

    end_process_group()
