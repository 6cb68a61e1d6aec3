"""A batch's mode and the epoch position belong to the loader that yielded it; resume checks."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.read.resume import ResumeError, dataset_fingerprint
from tests.lightning.test_datamodule import SmallCNN

CPU = torch.device("cpu")


def _dm(root: Path, **kw) -> ShardDataModule:
    options = dict(
        batch_size=32, workers=WorkerSettings(num_workers=0, prefetch_factor=2), backend="cpu"
    )
    return ShardDataModule(root, **(options | kw))


def _step(dm: ShardDataModule, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch through the README's Trainer-less contract."""
    return dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, CPU, 0), 0)


def _train_batches(root: Path, validate_after: int | None, workers: int) -> tuple[list, int]:
    dm = _dm(
        root, workers=WorkerSettings(num_workers=workers, prefetch_factor=2), splits={"val": "test"}
    )
    out = []
    for step, batch in enumerate(dm.train_dataloader(), start=1):
        out.append(_step(dm, batch)[0])
        if step == validate_after:  # a validation run in the middle of the epoch
            for val_batch in dm.val_dataloader():
                x, _ = _step(dm, val_batch)
                assert x.shape[-2:] == (8, 8)
        if step == 7:
            break
    return out, dm.state_dict()["consumed"]


@pytest.mark.parametrize("workers", [0, 2])
def test_custom_loop_validation_mid_epoch_changes_neither_mode_nor_position(tiny_shards, workers):
    plain, consumed = _train_batches(tiny_shards, None, workers)
    validated, consumed_validated = _train_batches(tiny_shards, 3, workers)
    assert consumed == consumed_validated == 7 * 32
    for a, b in zip(plain, validated, strict=True):  # still augmented as training batches
        assert torch.equal(a, b)


def _labels(dm: ShardDataModule, stop: int | None = None) -> list[list[int]]:
    out = []
    for step, batch in enumerate(dm.train_dataloader(), start=1):
        out.append(_step(dm, batch)[1].tolist())
        if step == stop:
            break
    return out


def test_custom_loop_resumes_a_saved_position_in_a_later_epoch(tiny_shards):
    reference = _dm(tiny_shards)
    _labels(reference)
    epoch1 = _labels(reference)
    run = _dm(tiny_shards)
    _labels(run)
    assert _labels(run, stop=4) == epoch1[:4]
    state = run.state_dict()
    assert (state["epoch"], state["steps"], state["consumed"]) == (1, 4, 128)
    resumed = _dm(tiny_shards)
    resumed.load_state_dict(state)
    assert _labels(resumed) == epoch1[4:]  # epoch 1 from its 5th batch, not epoch 0 again
    assert resumed.state_dict()["epoch"] == 1


def _state(root: Path, **fields) -> dict:
    manifest = load_manifest(root)
    state = {
        "version": 2, "epoch": 0, "consumed": 128, "steps": 4, "seed": 0, "world_size": 1,
        "batch_size": 32, "num_samples": manifest.split("train").num_samples,
        "dataset": dataset_fingerprint(manifest, "train"),
    }  # fmt: skip
    return state | fields


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (None, "is a NoneType, not the dict"),
        ({"steps": 10**9}, "'steps' .*exceeds twice 'num_samples'"),
        ({"consumed": "128"}, "'consumed' must be an integer, got '128'"),
        ({"epoch": 1.5}, "'epoch' must be an integer"),
        ({"batch_size": True}, "'batch_size' must be an integer"),
        ({"epoch": -1}, "'epoch' must be >= 0"),
        ({"world_size": 0}, "'world_size' must be >= 1"),
        ({"consumed": 10**6}, "'consumed' .*exceeds 'num_samples'"),
        ({"steps": 601}, "'steps' \\(601\\) exceeds twice 'num_samples' \\(300\\)"),
        ({"dataset": 123}, "'dataset' must be 16 hex digits"),
        ({"mix": ["a"]}, "'mix' must be a string"),
        ({"num_samples": 301}, "another dataset"),
    ],
)
def test_every_field_of_a_state_is_validated(tiny_shards, change, message):
    state = None if change is None else _state(tiny_shards, **change)
    with pytest.raises(ResumeError, match=message):
        _dm(tiny_shards).load_state_dict(state)
    _dm(tiny_shards).load_state_dict(_state(tiny_shards))  # the unchanged state is accepted


def test_a_position_counted_after_a_restarted_epoch_loads_again(tiny_shards):
    # A run resumed from a checkpoint without a data position restarts the epoch's samples after
    # counting its earlier steps, so its later states have more steps than samples consumed.
    for steps, consumed in ((100, 0), (110, 20)):
        _dm(tiny_shards).load_state_dict(_state(tiny_shards, steps=steps, consumed=consumed))


def test_missing_field_is_named(tiny_shards):
    state = _state(tiny_shards)
    del state["steps"]
    with pytest.raises(ResumeError, match="lacks field 'steps'"):
        _dm(tiny_shards).load_state_dict(state)


def _trainer(tmp_path: Path, **kw) -> pl.Trainer:
    options = dict(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    return pl.Trainer(**(options | kw))


def test_checkpoint_without_the_datamodule_entry_restarts_the_epoch_with_a_warning(
    tiny_shards, tmp_path, caplog
):
    every3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path, callbacks=[every3]).fit(SmallCNN(300), datamodule=_dm(tiny_shards))
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=False)
    assert checkpoint.pop("ShardDataModule")["steps"] == 3
    torch.save(checkpoint, tmp_path / "no-dm.ckpt")

    model = SmallCNN(300)
    with caplog.at_level("WARNING", logger="fastdata"):
        _trainer(tmp_path, enable_checkpointing=False).fit(
            model, datamodule=_dm(tiny_shards), ckpt_path=tmp_path / "no-dm.ckpt"
        )
    assert "restarts from its first sample" in caplog.text and "epoch 0 after 3" in caplog.text
    # The whole epoch after the restored 3 steps: every sample once, none skipped.
    assert len(model.seen) == 9 * 32 and len(set(model.seen)) == 9 * 32
