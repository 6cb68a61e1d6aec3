"""A scheduled mix (`fastdata.read.schedule`) under a Lightning `Trainer`: every batch holds the
schedule's counts, a checkpoint resumes the same batches, and a new schedule on resume applies from
the checkpoint's position with a warning. Labels < N_A are samples of dataset A (tests/read/test_mix.py).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from fastdata import Schedule, ShardDataModule, ShardSet, WorkerSettings
from fastdata.read.schedule import share_counts
from tests.lightning.test_datamodule import SmallCNN
from tests.read.test_mix import N_A, N_B, _write

EASY = Schedule([(0, 0.8), (100, 0.5), (250, 0.2)])
HARD = Schedule([(0, 0.2), (100, 0.5), (250, 0.8)])
E = N_A + N_B


class Recorder(SmallCNN):
    """Keeps each training batch's labels."""

    def __init__(self) -> None:
        super().__init__(E)
        self.batches: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch[1].tolist())
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("fit")
    return [_write(base / "a", "a", N_A, 10, 1), _write(base / "b", "b", N_B, 10, 2)]


def _dm(roots, a=EASY, b=HARD) -> ShardDataModule:
    return ShardDataModule(
        [ShardSet(roots[0], weight=a), ShardSet(roots[1], weight=b)],
        batch_size=10,
        seed=3,
        backend="cpu",
        drop_last=False,
        workers=WorkerSettings(num_workers=0),
    )


def _fit(tmp_path, roots, ckpt=None, callbacks=(), **weights) -> Recorder:
    model = Recorder()
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
    )  # fmt: skip
    trainer.fit(model, datamodule=_dm(roots, **weights), ckpt_path=ckpt)
    return model


def _hold_the_schedule(batches, first_step, a=EASY, b=HARD) -> None:
    for step, labels in enumerate(batches, start=first_step):
        from_a = sum(y < N_A for y in labels)
        assert (from_a, len(labels) - from_a) == share_counts(10, (a(10 * step), b(10 * step)))


def test_fit_follows_the_schedule_and_resumes_with_a_new_one(roots, tmp_path, caplog):
    every3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    whole = _fit(tmp_path, roots, callbacks=[every3]).batches
    assert len(whole) == 2 * E // 10
    _hold_the_schedule(whole, 0)  # epoch 1's steps continue the global positions: 160, 170, ...
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    assert _fit(tmp_path, roots, ckpt=checkpoint).batches == whole[6:]  # same schedule: exact
    with caplog.at_level("WARNING", logger="fastdata"):
        flipped = _fit(tmp_path, roots, ckpt=checkpoint, a=HARD, b=EASY).batches
    assert "schedule changed at global sample position 60 " in caplog.text
    assert len(flipped) == len(whole) - 6
    _hold_the_schedule(flipped, 6, HARD, EASY)  # the new weights, from the checkpoint on
    from_b = [y for labels in whole[:6] + flipped[:10] for y in labels if y >= N_A]
    assert len(from_b) == len(set(from_b))  # B's stream continued after what it had given
