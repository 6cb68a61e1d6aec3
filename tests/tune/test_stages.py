"""StageTimer: stage times in the trainer's loggers, and the epoch-end line naming the bound stage."""

from __future__ import annotations

import csv
import importlib
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from fastdata.read.transport.stage_times import BatchStages, StageTimes
from fastdata.tune.stage_report import StageFigures, bound
from fastdata.tune.stages import StageTimer
from tests.conftest import quiet_trainer

STEPS, BATCH, SLOW_S = 16, 4, 0.03


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Loader:
    """Batches after `wait_s` each, reporting (read_s, decode_s) as the cpu backend does."""

    def __init__(self, wait_s: float = 0.0, made: tuple[float, float] | None = None) -> None:
        self.wait_s, self.made = wait_s, made
        self.last_stages: BatchStages | None = None

    def __len__(self) -> int:
        return STEPS

    def __iter__(self):
        for _ in range(STEPS):
            time.sleep(self.wait_s)
            self.last_stages = None if self.made is None else BatchStages(*self.made)
            yield torch.randn(BATCH, 4), torch.zeros(BATCH, dtype=torch.int64)


def _module_class(lp):
    class Model(lp.LightningModule):
        def __init__(self, step_s: float = 0.0) -> None:
            super().__init__()
            self.layer, self.step_s = torch.nn.Linear(4, 2), step_s

        def training_step(self, batch, batch_idx):
            time.sleep(self.step_s)
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model


def _datamodule_class(lp):
    class Data(lp.LightningDataModule):
        def __init__(self, loader: _Loader, augment_s: float = 0.0) -> None:
            super().__init__()
            self.loader, self.augment_s = loader, augment_s

        def train_dataloader(self):
            return self.loader

        def on_after_batch_transfer(self, batch, dataloader_idx):
            time.sleep(self.augment_s)  # a slow device augmentation
            return batch

    return Data


def _fit(timer, loader, step_s=0.0, augment_s=0.0, logger=False, lp=pl, **kw):
    trainer = quiet_trainer(
        package=lp,
        logger=logger,
        num_sanity_val_steps=0,
        callbacks=[timer],
        **kw,
    )
    data = _datamodule_class(lp)(loader, augment_s)
    trainer.fit(_module_class(lp)(step_s), datamodule=data)
    return trainer


@pytest.mark.timeout(120)
def test_csv_logger_receives_every_stage_key(tmp_path: Path):
    timer = StageTimer()
    logger = CSVLogger(tmp_path, name="logs")
    _fit(timer, _Loader(0.005, made=(0.001, 0.004)), logger=logger, log_every_n_steps=5)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = {k for row in rows for k, v in row.items() if v}
    stages = ("wait", "read", "decode", "transfer", "augment", "step")
    assert {f"stages/{s}_ms" for s in stages} <= keys
    assert {f"stages/epoch_{s}_ms" for s in stages} <= keys
    decode = [float(r["stages/decode_ms"]) for r in rows if r.get("stages/decode_ms")]
    assert len(decode) == 3 and all(v == pytest.approx(4.0) for v in decode)  # 15 steps / 5
    waits = [float(r["stages/wait_ms"]) for r in rows if r.get("stages/wait_ms")]
    assert all(4.0 <= w < 100.0 for w in waits)  # a 5 ms sleep, on a possibly loaded machine


@pytest.mark.timeout(120)
def test_a_slow_decode_is_named_with_more_workers():
    timer = StageTimer()
    # The loader's maker spends most of its time decoding; the step waits for it.
    _fit(timer, _Loader(SLOW_S, made=(0.1 * SLOW_S, 0.9 * SLOW_S)))
    (result,) = timer.bounds
    assert result.kind == "input" and result.stage == "decode"
    assert result.shares["decode"] > 0.6
    assert "input-bound: decode" in timer.lines[0]
    assert "raise workers to" in result.advice or "backend='memory'" in result.advice


@pytest.mark.timeout(120)
def test_a_slow_augmentation_is_named():
    timer = StageTimer()
    _fit(timer, _Loader(0.0, made=(0.0001, 0.0001)), augment_s=SLOW_S)
    (result,) = timer.bounds
    assert result.kind == "input" and result.stage == "augment"
    assert result.shares["augment"] > 0.6
    assert "input-bound: augment" in timer.lines[0]


@pytest.mark.timeout(120)
def test_a_slow_step_is_compute_bound():
    timer = StageTimer()
    _fit(timer, _Loader(0.0), step_s=SLOW_S)
    (result,) = timer.bounds
    assert result.kind == "compute" and result.data_frac < 0.2
    assert "compute-bound" in timer.lines[0]


@pytest.mark.timeout(120)
def test_steps_after_a_mid_epoch_validation_are_timed():
    class Data(_datamodule_class(pl)):
        def val_dataloader(self):
            data = torch.utils.data.TensorDataset(
                torch.randn(2 * BATCH, 4), torch.zeros(2 * BATCH, dtype=torch.int64)
            )
            return torch.utils.data.DataLoader(data, batch_size=BATCH)

    class Model(_module_class(pl)):
        def validation_step(self, batch, batch_idx):
            return None

    timer = StageTimer()
    trainer = quiet_trainer(
        num_sanity_val_steps=0,
        val_check_interval=0.5,
        callbacks=[timer],
    )
    trainer.fit(Model(), datamodule=Data(_Loader(0.0), augment_s=0.01))
    # The epoch's first step and the one after the validation have no interval: 14 of 16.
    assert timer._epoch.steps == STEPS - 2
    assert timer._epoch.mean_ms("augment") >= 9.0  # every counted step's augmentation
    assert timer.bounds[0].stage == "augment"


@pytest.mark.timeout(120)
def test_pytorch_lightning_import_style():
    lp = pytest.importorskip("pytorch_lightning")
    timer = StageTimer()
    _fit(timer, _Loader(SLOW_S, made=(0.9 * SLOW_S, 0.1 * SLOW_S)), lp=lp)
    (result,) = timer.bounds
    assert result.kind == "input" and result.stage == "read"


@pytest.mark.timeout(120)
def test_the_cpu_backend_reports_each_batch_read_and_decode(tiny_shards: Path, tmp_path: Path):
    from fastdata.lightning.datamodule import ShardDataModule
    from fastdata.read import WorkerSettings

    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        backend="cpu",
        workers=WorkerSettings(num_workers=2, prefetch_factor=2),
    )

    class Model(_module_class(pl)):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3 * 8 * 8, 300)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1).float()), y)

    timer = StageTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(Model(), datamodule=dm)
    epoch_read = trainer.callback_metrics["stages/epoch_read_ms"]
    assert float(epoch_read) > 0  # every batch's maker reported its reading
    assert timer.bounds[0].stage in ("read", "decode", "wait", "transfer", "augment")


def test_cpu_workers_time_the_decode_of_photos(tmp_path: Path):
    import dataclasses

    from fastdata.read import WorkerSettings
    from fastdata.read.backends.cpu import make_cpu_loader
    from fastdata.tune import tuning_spec
    from fastdata.write import ShardOptions, write_shards
    from fastdata.write.sources import open_source
    from tests.conftest import write_jpeg_folder

    folder = write_jpeg_folder(tmp_path / "photos", classes=2, per_class=12, size=(64, 48))
    out = tmp_path / "shards"
    write_shards(open_source("folder", folder), out, ShardOptions(workers=1, progress=False))
    spec = tuning_spec(out, "train", batch_size=8, image_size=32)
    for workers in (0, 2):
        loader = make_cpu_loader(
            dataclasses.replace(spec, workers=WorkerSettings(num_workers=workers))
        )
        try:
            made = []
            for _ in loader:
                made.append(loader.last_stages)
        finally:
            loader.close()
        assert len(made) == 3 and all(m is not None for m in made)  # every batch, in order
        assert all(m.read_s > 0 and m.decode_s > 0 for m in made)


def test_stage_times_ring_names_its_batch():
    times = StageTimes()
    times.record(3, 7, 0.25, 0.5)
    assert times.take(3, 7) == (0.25, 0.5)
    assert times.take(3, 7).decode_s == 0.5
    assert times.take(4, 7) is None and times.take(3, 8) is None


def test_bound_advice_follows_cores_and_device():
    decode_heavy = StageFigures(
        epoch=0, step_s=0.1, wait_s=0.06, read_s=0.01, decode_s=0.09, workers=1, usable_cores=8
    )
    result = bound(decode_heavy)
    # compute 40 ms per step, a batch costs 100 ms to make: 3 workers keep up.
    assert result.workers == 3 and "raise workers to 3 (now 1)" in result.advice
    few_cores = bound(StageFigures(**{**decode_heavy.__dict__, "usable_cores": 2}))
    assert "no core is left for 3 workers" in few_cores.advice
    assert "backend='memory'" in few_cores.advice
    gpu = bound(StageFigures(**{**decode_heavy.__dict__, "usable_cores": 2, "on_gpu": True}))
    assert "nvjpeg" in gpu.advice
    transfer = bound(StageFigures(epoch=1, step_s=0.1, wait_s=0.0, transfer_s=0.05))
    assert transfer.stage == "transfer" and "pin_memory" in transfer.advice
    idle = bound(
        StageFigures(epoch=2, step_s=0.1, wait_s=0.001, read_s=0.01, decode_s=0.01, workers=4)
    )
    assert idle.kind == "compute" and "1 workers would also keep up (now 4)" in idle.line
    with pytest.raises(ValueError, match="threshold"):
        bound(decode_heavy, threshold=1.5)


def test_the_callback_needs_a_fraction():
    with pytest.raises(ValueError, match="threshold"):
        StageTimer(threshold=0)
    assert importlib.import_module("fastdata.tune.stages").StageTimer is StageTimer
