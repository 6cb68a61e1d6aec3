"""Trainer features a DataModule must honour: overfit_batches, reload_dataloaders_every_n_epochs,
val_check_interval, fast_dev_run, Tuner.scale_batch_size; with both Lightning packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdata import ShardDataModule, WorkerSettings
from tests.lightning.models import PACKAGES, QUIET, lightning_package, small_cnn

pytest.importorskip("pytorch_lightning")


def _dm(root: Path, batch_size: int = 32) -> ShardDataModule:
    return ShardDataModule(
        root,
        batch_size=batch_size,
        backend="cpu",
        splits={"val": "test"},
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_overfit_batches_trains_on_the_same_batches_every_epoch(tiny_shards, package):
    pkg = lightning_package(package)
    model = small_cnn(pkg)()
    trainer = pkg.Trainer(max_epochs=3, overfit_batches=2, num_sanity_val_steps=0, **QUIET)
    trainer.fit(model, datamodule=_dm(tiny_shards))
    epochs = [model.seen[i : i + 2] for i in range(0, 6, 2)]
    assert len(model.seen) == 6 and epochs[0] == epochs[1] == epochs[2]
    assert len({label for batch in epochs[0] for label in batch}) == 64


def test_overfit_batches_after_a_resume_trains_on_the_same_batches(tiny_shards, tmp_path):
    """An end-of-epoch checkpoint's data position must not move the overfit window along."""
    pkg = lightning_package("lightning.pytorch")
    first = small_cnn(pkg)()
    options = dict(overfit_batches=2, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer = pkg.Trainer(max_epochs=1, **options, **QUIET)
    trainer.fit(first, datamodule=_dm(tiny_shards))
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    resumed = small_cnn(pkg)()
    trainer = pkg.Trainer(max_epochs=2, **options, **QUIET)
    trainer.fit(resumed, datamodule=_dm(tiny_shards), ckpt_path=tmp_path / "epoch0.ckpt")
    assert len(resumed.seen) == 2 and resumed.seen == first.seen


def test_overfit_batches_keeps_the_augmentation_too(tiny_shards):
    """The first epoch's batches, augmentation included: pixel for pixel the same each epoch."""
    pkg = lightning_package("lightning.pytorch")
    sums: list[float] = []

    class Recording(small_cnn(pkg)):
        def training_step(self, batch, batch_idx):
            sums.append(float(batch[0].double().sum()))
            return super().training_step(batch, batch_idx)

    trainer = pkg.Trainer(max_epochs=2, overfit_batches=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(Recording(), datamodule=_dm(tiny_shards))
    assert len(sums) == 2 and sums[0] == sums[1]


def test_reload_dataloaders_every_epoch_continues_the_epochs(tiny_shards):
    pkg = lightning_package("lightning.pytorch")
    dm = _dm(tiny_shards)
    model = small_cnn(pkg)()
    trainer = pkg.Trainer(
        max_epochs=3, reload_dataloaders_every_n_epochs=1, limit_val_batches=1, **QUIET
    )
    trainer.fit(model, datamodule=dm)
    epochs = [sum(model.seen[i : i + 9], []) for i in range(0, 27, 9)]
    assert len(model.seen) == 27
    assert all(len(set(epoch)) == 9 * 32 for epoch in epochs)  # each a whole epoch, no repeat
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch, not epoch 0 again
    assert dm.state_dict()["epoch"] == 2


@pytest.mark.parametrize("package", PACKAGES)
def test_val_check_interval_validates_mid_epoch(tiny_shards, package):
    pkg = lightning_package(package)
    model = small_cnn(pkg)()
    trainer = pkg.Trainer(
        max_epochs=1, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0, **QUIET
    )
    trainer.fit(model, datamodule=_dm(tiny_shards))
    assert len(model.seen) == 9 and len(model.val_seen) == 3  # after steps 3, 6 and 9
    assert model.val_seen[0] == model.val_seen[1]  # evaluation batches are not shuffled


@pytest.mark.parametrize("package", PACKAGES)
def test_fast_dev_run_takes_one_batch_of_each(tiny_shards, package):
    pkg = lightning_package(package)
    model = small_cnn(pkg)()
    dm = _dm(tiny_shards)
    trainer = pkg.Trainer(fast_dev_run=True, **QUIET)
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)
    assert len(model.seen) == 1 and len(model.val_seen) == 1
    assert "test_loss" in trainer.callback_metrics


@pytest.mark.parametrize("package", PACKAGES)
def test_scale_batch_size_changes_the_datamodules_batch_size(tiny_shards, package, tmp_path):
    pkg = lightning_package(package)
    tuner_module = lightning_package(f"{package}.tuner")
    model = small_cnn(pkg)()
    dm = _dm(tiny_shards, batch_size=4)
    trainer = pkg.Trainer(max_epochs=1, limit_val_batches=1, default_root_dir=tmp_path, **QUIET)
    found = tuner_module.Tuner(trainer).scale_batch_size(
        model, datamodule=dm, mode="power", steps_per_trial=1, init_val=4, max_trials=3
    )
    assert found == dm.batch_size == 16  # 4 -> 8 -> 16, stopped by max_trials
    assert {len(batch) for batch in model.seen} == {4, 8, 16}  # each trial's loader used it
    model.seen.clear()
    trainer.fit(model, datamodule=dm)
    labels = [label for batch in model.seen for label in batch]
    assert {len(batch) for batch in model.seen} == {16}
    assert len(labels) == 18 * 16 == len(set(labels))  # a whole epoch from its start
