"""`ShardDataModule(source=...)`: sharding in `prepare_data` (`fastdata.lightning.prepare`).

A tiny class-per-folder tree of real JPEG/PNG files in tmp_path is the source; each test checks
what a Lightning user relies on: the first fit shards then trains, the second writes nothing, a
killed sharding resumes, another source or other options are refused naming both, a rank that
waits for a writer that never comes stops with an error, progress shows on rank 0 only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from fastdata import (
    SegmentationDataModule,
    ShardDataModule,
    ShardOptions,
    ShardSource,
    WorkerSettings,
)
from fastdata.format.manifest import ManifestError
from fastdata.lightning.prepare import ShardsNotReadyError, SourceMismatchError
from fastdata.write.sources import BadSourceError
from tests.conftest import write_jpeg_folder

REPO = Path(__file__).resolve().parents[2]


def _source(images: Path, **options) -> ShardSource:
    settings = {"max_count": 4, "workers": 1, "progress": False} | options
    return ShardSource("folder", str(images), options=ShardOptions(**settings))


def _dm(root: Path, source: ShardSource, **kw) -> ShardDataModule:
    return ShardDataModule(
        root,
        source=source,
        batch_size=4,
        backend="cpu",
        image_size=16,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
        **kw,
    )


class _Tiny(pl.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.steps += 1
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dm: ShardDataModule) -> _Tiny:
    model = _Tiny(3)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    return model


def _snapshot(folder: Path) -> dict[str, int]:
    """Each entry's modification time, and the folder's (a lock file made and removed shows)."""
    return {".": folder.stat().st_mtime_ns} | {
        p.name: p.stat().st_mtime_ns for p in folder.iterdir()
    }


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return write_jpeg_folder(tmp_path / "images", classes=3, per_class=4, size=(24, 20))


def test_first_fit_shards_then_trains_and_the_second_writes_nothing(images, tmp_path):
    root = tmp_path / "shards"
    model = _fit(_dm(root, _source(images)))
    assert model.steps == 2
    manifest = (root / "manifest.json").read_text()
    assert '"kind": "folder"' in manifest and len(list(root.glob("*.tar"))) == 3  # 12 / 4
    before = _snapshot(root)
    time.sleep(0.01)  # a rewrite would show in the times
    dm = _dm(root, _source(images))
    model = _fit(dm)
    assert model.steps == 2 and dm.num_classes == 3
    assert _snapshot(root) == before  # no file written, not even the lock file


def test_a_killed_sharding_resumes_without_rewriting_finished_shards(images, tmp_path, monkeypatch):
    root, hooks = tmp_path / "shards", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "delay").write_text("0.5")  # each shard waits: the run is killed after the first
    # What dm.prepare_data() runs, without importing Lightning (a faster start to kill).
    script = textwrap.dedent(f"""
        from fastdata.lightning.prepare import ShardSource, prepare_shards
        from fastdata.write import ShardOptions
        options = ShardOptions(max_count=4, workers=1, progress=False)
        prepare_shards(ShardSource("folder", {str(images)!r}, options=options), {str(root)!r}, True)
    """)
    env = {**os.environ, "FASTDATA_TEST_HOOKS": str(hooks), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list((root / ".fastdata-work").glob("*.done*")):
            assert proc.poll() is None and time.monotonic() < deadline, "no shard finished"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (root / "manifest.json").exists()
    first = (hooks / "written.log").read_text().split()
    (hooks / "delay").unlink()
    (hooks / "written.log").unlink()

    dm = _dm(root, _source(images))
    monkeypatch.setenv("FASTDATA_TEST_HOOKS", str(hooks))  # logs the shards written here
    dm.prepare_data()
    resumed = (hooks / "written.log").read_text().split()
    assert first[0] not in resumed  # the shard finished before the kill is not written again
    assert sorted(set(first[:1] + resumed)) == ["train-000000", "train-000001", "train-000002"]
    dm.setup("fit")
    assert dm.manifest.split("train").num_samples == 12


def test_another_source_or_other_options_are_refused_naming_both(images, tmp_path):
    root = tmp_path / "shards"
    _dm(root, _source(images)).prepare_data()
    with pytest.raises(SourceMismatchError) as caught:
        _dm(root, _source(images, max_count=5)).prepare_data()
    message = str(caught.value)
    assert str(root) in message and "options.max_count" in message
    assert "'max_count': 4" in message and "'max_count': 5" in message  # both named
    other = write_jpeg_folder(tmp_path / "other", classes=2, per_class=3)
    with pytest.raises(SourceMismatchError) as caught:
        _dm(root, _source(other)).prepare_data()
    assert str(images) in str(caught.value) and str(other) in str(caught.value)
    # A rank that does not shard (setup only) checks the recorded kind and options.
    dm = _dm(root, _source(images, max_count=5))
    with pytest.raises(SourceMismatchError, match="options.max_count"):
        dm.setup("fit")


def test_an_unfinished_sharding_of_other_options_is_refused(images, tmp_path):
    root = tmp_path / "shards"
    (root / ".fastdata-work").mkdir(parents=True)
    (root / ".fastdata-work" / "plan.json").write_text(
        '{"kind": "folder", "fingerprint": {"root": "/elsewhere"}, "options": {}}'
    )
    with pytest.raises(SourceMismatchError, match="unfinished sharding of 'folder' /elsewhere"):
        _dm(root, _source(images)).prepare_data()


def test_a_rank_waiting_for_a_writer_that_never_comes_stops_naming_folder_and_timeout(
    images, tmp_path
):
    """prepare_data_per_node=False: this rank's node never shards; its setup waits, bounded."""
    root = tmp_path / "node-local"
    source = ShardSource("folder", str(images), options=ShardOptions(workers=1), timeout=0.5)
    dm = _dm(root, source, rank=1, world_size=2)  # a rank of two: another one writes
    dm.prepare_data_per_node = False
    started = time.monotonic()
    with pytest.raises(
        ShardsNotReadyError, match=r"node-local/manifest.json did not appear within 0.5 s"
    ):
        dm.setup("fit")
    assert time.monotonic() - started < 10


def test_setup_without_prepare_data_in_one_process_says_what_to_call_at_once(images, tmp_path):
    # A plain script or notebook: no writer to wait for, so no wait of ShardSource.timeout.
    dm = _dm(tmp_path / "shards", _source(images))
    started = time.monotonic()
    with pytest.raises(ManifestError, match=r"call dm.prepare_data\(\) before"):
        dm.setup("fit")
    assert time.monotonic() - started < 5
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_classes == 3


def test_shards_without_their_raw_data_are_used_when_kind_and_options_match(
    images, tmp_path, caplog
):
    # A node that received the shards but not the photos (or the photos deleted after sharding).
    root = tmp_path / "shards"
    _dm(root, _source(images)).prepare_data()
    written = (root / "manifest.json").read_bytes()
    images.rename(tmp_path / "gone")
    with caplog.at_level("WARNING", logger="fastdata"):
        _dm(root, _source(images)).prepare_data()
    assert (root / "manifest.json").read_bytes() == written
    assert "the source cannot be read" in caplog.text
    with pytest.raises(SourceMismatchError, match="max_count"):
        _dm(root, _source(images, max_count=3)).prepare_data()
    with pytest.raises(BadSourceError, match="not a folder"):  # no shards, no source: its error
        _dm(tmp_path / "other", _source(images)).prepare_data()


def test_a_path_in_the_sources_arguments_is_kept_as_text(images, tmp_path):
    # save_hyperparameters + torch.load(weights_only=True) refuse a PosixPath.
    source = ShardSource("folder", images, args={"root": tmp_path / "x"})
    assert source.args == {"root": str(tmp_path / "x")} and source.path == str(images)


def test_progress_shows_on_rank_zero_only(images, tmp_path, capfd):
    for rank in (1, 0):
        source = _source(images, progress=True)
        _dm(tmp_path / f"rank{rank}", source, rank=rank, world_size=2).prepare_data()
        shown = "sharding ->" in capfd.readouterr().err
        assert shown == (rank == 0), f"rank {rank}"


def test_source_is_refused_with_a_mix_or_a_url(images, tmp_path):
    with pytest.raises(ValueError, match="mix"):
        ShardDataModule([str(tmp_path / "a"), str(tmp_path / "b")], source=_source(images))
    with pytest.raises(ValueError, match="URL"):
        ShardDataModule("s3://bucket/shards", source=_source(images))
    with pytest.raises(ValueError, match="unknown source kind"):
        ShardSource("folders", str(images))


def test_lightning_cli_builds_the_source_from_arguments_and_fit_shards(
    images, tmp_path, monkeypatch
):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    from tests.lightning.models import lightning_package, small_cnn

    monkeypatch.setattr(sys, "argv", ["train.py"])
    root = tmp_path / "shards"
    args = [
        "fit",
        f"--data.root={root}",
        "--data.source.kind=folder",
        f"--data.source.path={images}",
        "--data.source.options.max_count=4",
        "--data.source.options.workers=1",
        "--data.source.options.progress=false",
        "--data.batch_size=4",
        "--data.image_size=16",
        "--data.backend=cpu",
        "--data.workers.num_workers=0",
        "--data.workers.prefetch_factor=2",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    model = small_cnn(lightning_package("lightning.pytorch"))
    cli = LightningCLI(model, ShardDataModule, args=args, save_config_callback=None)
    assert cli.datamodule.source == _source(images)
    assert cli.trainer.global_step == 2 and len(list(root.glob("*.tar"))) == 3


def test_fabric_prepares_then_sets_up(images, tmp_path):
    """Fabric has no prepare_data hook: one rank per node calls it, then every rank's setup."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    dm = _dm(tmp_path / "shards", _source(images))
    with fabric.rank_zero_first(local=True):  # local rank 0 shards; the others find its shards
        dm.prepare_data()
    dm.setup("fit")
    train = fabric.setup_dataloaders(dm.train_dataloader().as_dataloader())
    labels = [y for batch in train for y in dm.on_after_batch_transfer(batch, 0)[1].tolist()]
    assert len(labels) == 12 and sorted(set(labels)) == [0, 1, 2]


def test_reading_the_dataset_before_prepare_data_says_to_call_it(images, tmp_path):
    dm = _dm(tmp_path / "shards", _source(images))
    with pytest.raises(ManifestError, match=r"call dm.prepare_data\(\) before reading num_classes"):
        _ = dm.num_classes
    dm.prepare_data()
    assert dm.num_classes == 3 and dm.classes == ["class0", "class1", "class2"]


def test_a_family_member_shards_a_source_of_several_inputs(tmp_path):
    """SegmentationDataModule with a segmentation source: images and masks, paired by stem."""
    from tests.write.sources.family_data import write_segmentation

    images, masks = write_segmentation(tmp_path / "seg", count=4)
    options = ShardOptions(max_count=2, workers=1, progress=False)
    source = ShardSource("segmentation", [str(images), str(masks)], options=options)
    dm = SegmentationDataModule(
        tmp_path / "shards", source=source, batch_size=2, backend="cpu", image_size=32,
        train_transforms="none", workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    batch = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert batch["image"].shape == (2, 3, 32, 32) and batch["mask"].shape == (2, 32, 32)
    assert str(images) in (tmp_path / "shards" / "manifest.json").read_text()


class _SavingModule(ShardDataModule):
    """A user's subclass that records its arguments (`save_hyperparameters`)."""

    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.save_hyperparameters()


def test_the_source_survives_save_hyperparameters_and_a_checkpoint(images, tmp_path):
    """torch's default `weights_only=True` load rebuilds the ShardSource and its ShardOptions."""
    source = ShardSource("folder", images, options=ShardOptions(max_count=4, workers=1))
    assert source.path == str(images)  # a Path is kept as a string: plain data
    dm = _SavingModule(
        str(tmp_path / "shards"), source=source, batch_size=4, backend="cpu", image_size=16,
        workers=WorkerSettings(num_workers=0, prefetch_factor=2),
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_Tiny(3), datamodule=dm)
    path = next(tmp_path.rglob("*.ckpt"))
    assert torch.load(path, weights_only=True)["datamodule_hyper_parameters"]["source"] == source
    assert _SavingModule.load_from_checkpoint(path).source == source
