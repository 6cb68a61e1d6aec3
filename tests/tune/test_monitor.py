"""LoaderMonitor on a tiny Lightning run with a known injected loader delay."""

from __future__ import annotations

import itertools
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from fastdata.tune.monitor import LoaderMonitor, energy_delta
from tests.conftest import quiet_trainer

# 40 ms: long enough that sleep overshoot and Lightning's per-step bookkeeping (a few ms on a
# loaded 2-core machine) stay well inside the 20% tolerance.
DELAY_S = 0.04
STEPS = 20
BATCH = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _SlowBatches(Dataset):
    """Whole batches; each one takes `delay` seconds to make (like a slow decoder)."""

    def __init__(self, delay: float, n: int = STEPS) -> None:
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return torch.randn(BATCH, 4), torch.zeros(BATCH, dtype=torch.int64)


class _Model(pl.LightningModule):
    def __init__(self, step_delay: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.step_delay = step_delay

    def training_step(self, batch, batch_idx):
        if self.step_delay:
            time.sleep(self.step_delay)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DataModule(pl.LightningDataModule):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.num_workers, self.resized = delay, 0, []

    def train_dataloader(self):
        return DataLoader(_SlowBatches(self.delay), batch_size=None, num_workers=self.num_workers)

    def resize_workers(self, n: int) -> None:
        self.resized.append(n)


class _FakeGpu:
    def __init__(self) -> None:
        self.joules = itertools.count(100.0, 0.5)

    def utilization(self) -> float:
        return 80.0

    def memory_used(self) -> int:
        return 3 * 2**30

    def energy_j(self) -> float:
        return next(self.joules)


def _fit(
    monitor,
    step_delay=0.0,
    load_delay=DELAY_S,
    datamodule=None,
    logger=False,
    extra_callbacks=(),
    **trainer_kw,
):
    trainer = quiet_trainer(
        **trainer_kw,
        logger=logger,
        num_sanity_val_steps=0,
        callbacks=[monitor, *extra_callbacks],
    )
    model = _Model(step_delay)
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule)
    else:
        loader = DataLoader(_SlowBatches(load_delay), batch_size=None, num_workers=0)
        trainer.fit(model, train_dataloaders=loader)
    return trainer


@pytest.mark.timeout(120)
def test_data_wait_matches_injected_delay():
    monitor = LoaderMonitor(
        gpu_reader=None, energy_reader=lambda: None, resize=False, max_workers=lambda t: 2
    )
    trainer = _fit(monitor)
    s = monitor.summary
    assert s["steps"] == STEPS and s["samples"] == STEPS * BATCH
    assert s["data_wait_ms"] == pytest.approx(DELAY_S * 1e3, rel=0.2)
    assert s["data_wait_frac"] > 0.7
    assert s["samples_per_s"] < BATCH / DELAY_S
    assert s["energy_j_per_1k_samples"] is None and s["gpu_util"] is None
    assert "2 workers would keep up better (now 0); resizing is off" in s["action"]
    assert trainer.callback_metrics["loader/data_wait_frac"] > 0.7


@pytest.mark.timeout(120)
def test_no_delay_and_slow_step_gives_small_fraction():
    monitor = LoaderMonitor(gpu_reader=None, energy_reader=lambda: None)
    _fit(monitor, step_delay=DELAY_S, load_delay=0.0)
    s = monitor.summary
    assert s["data_wait_frac"] < 0.2
    assert s["step_ms"] >= DELAY_S * 1e3
    assert s["action"] is None


@pytest.mark.timeout(120)
def test_over_threshold_resizes_through_the_datamodule(tmp_path):
    dm = _DataModule(DELAY_S)
    monitor = LoaderMonitor(
        gpu_reader=lambda device: _FakeGpu(),
        max_workers=lambda trainer: 3,
        log_every_n_steps=5,
    )
    _fit(monitor, datamodule=dm, logger=CSVLogger(tmp_path))
    # A 40 ms batch against a few-ms step needs many workers: capped at the 3 allowed.
    assert dm.resized == [3]
    assert monitor.summary["resized_to"] == 3
    assert "workers 0 -> 3" in monitor.summary["action"]
    assert monitor.summary["energy_source"] == "nvml"
    assert monitor.summary["energy_j_per_1k_samples"] > 0
    assert monitor.summary["gpu_util"] == 80.0
    logged = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "loader/data_wait_ms" in logged and "gpu/util" in logged


@pytest.mark.timeout(120)
def test_validation_inside_the_epoch_is_not_a_data_wait():
    monitor = LoaderMonitor(gpu_reader=None, energy_reader=lambda: None)
    trainer = quiet_trainer(
        num_sanity_val_steps=0,
        val_check_interval=10,  # a slow validation run in the middle of the epoch
        callbacks=[monitor],
    )
    train = DataLoader(_SlowBatches(0.0), batch_size=None)
    val = DataLoader(_SlowBatches(0.1, n=3), batch_size=None)
    trainer.fit(_Model(step_delay=DELAY_S), train_dataloaders=train, val_dataloaders=val)
    assert monitor.summary["data_wait_frac"] < 0.2
    assert max(monitor._epoch.waits) < 0.1  # no interval spans the 0.3 s of validation


def test_energy_delta_handles_wrap():
    assert energy_delta(10.0, 15.0, wrap=100.0) == 5.0
    assert energy_delta(95.0, 3.0, wrap=100.0) == 8.0


def test_bad_threshold():
    with pytest.raises(ValueError, match="threshold"):
        LoaderMonitor(threshold=1.5)


class _SlowAfterBatch(pl.Callback):
    """Stands for work other callbacks do after the step (checkpoint saves, logging syncs)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(DELAY_S)


@pytest.mark.timeout(120)
def test_other_callbacks_after_the_step_are_not_a_data_wait():
    # An instant loader with slow end-of-step callbacks: only the loader's own next() counts.
    monitor = LoaderMonitor(gpu_reader=None, energy_reader=lambda: None, resize=False)
    _fit(monitor, load_delay=0.0, extra_callbacks=[_SlowAfterBatch()])
    s = monitor.summary
    assert s["step_ms"] >= DELAY_S * 1e3
    assert s["data_wait_frac"] < 0.1 and s["action"] is None


class _NoWorkerBackendModule(_DataModule):
    backend = "memory"  # a registered backend that runs no worker processes


@pytest.mark.timeout(120)
def test_a_backend_without_workers_is_not_resized():
    dm = _NoWorkerBackendModule(DELAY_S)
    monitor = LoaderMonitor(gpu_reader=None, energy_reader=lambda: None, max_workers=lambda t: 3)
    _fit(monitor, datamodule=dm)
    assert monitor.summary["data_wait_frac"] > 0.7
    assert dm.resized == []
    assert "'memory' backend runs no worker processes" in monitor.summary["action"]


def test_the_trainer_profiler_still_sees_every_action(tmp_path):
    from lightning.pytorch.profilers import SimpleProfiler

    profiler = SimpleProfiler(dirpath=tmp_path, filename="perf")
    monitor = LoaderMonitor(gpu_reader=None, energy_reader=lambda: None, resize=False)
    _fit(monitor, load_delay=0.0, profiler=profiler)
    assert any(name.endswith("train_dataloader_next") for name in profiler.recorded_durations)
    assert len(monitor._epoch.waits) == STEPS - 1
