"""Sizing that follows the load: the epoch-boundary re-check, on injected load readings."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from fastdata.tune import load as load_module
from fastdata.tune.follow import EpochFigures, Sizing, Trial, recheck
from fastdata.tune.load import CoreLoad, LoadMeter, LoadReaders, choose_threads, threads_for
from fastdata.tune.monitor import LoaderMonitor
from tests.conftest import quiet_trainer


def _figures(idle: float, wait_frac: float = 0.0, epoch: int = 0, **kw) -> EpochFigures:
    load = CoreLoad(usable_cores=2, others_cores=2 - idle, own_cores=1.0, window_s=10.0)
    step = 0.010
    defaults = {"wait_s": step * wait_frac, "compute_s": step * (1 - wait_frac)}
    return EpochFigures(epoch, load, wait_frac, **{**defaults, **kw})


@pytest.fixture(autouse=True)
def _no_recorded_choice():
    load_module._LAST_CHOICE.clear()
    threads = torch.get_num_threads()
    yield
    load_module._LAST_CHOICE.clear()
    torch.set_num_threads(threads)


# ---- the rule -------------------------------------------------------------------------------


def test_threads_follow_the_idle_cores_with_hysteresis():
    assert threads_for(0.9, 1, 2, None) == 1  # one core busy elsewhere at start-up
    assert threads_for(1.9, 1, 2, None) == 2
    assert threads_for(1.9, 1, 2, current=1) == 2  # the load went away
    assert threads_for(1.6, 1, 2, current=1) == 1  # noise: not clearly more idle
    assert threads_for(1.3, 1, 2, current=2) == 2  # noise: not clearly less idle
    assert threads_for(1.1, 1, 2, current=2) == 1  # another process took a core
    assert threads_for(3.9, 2, 4, None) == 2  # two ranks share the idle cores
    assert threads_for(0.0, 1, 2, None) == 1  # never fewer than one


def test_recheck_raises_threads_after_the_load_ends_and_says_why():
    result = recheck(Sizing(threads=1, num_workers=None), _figures(1.9, epoch=2, previous_idle=0.9))
    assert result.sizing.threads == 2
    assert result.changes == ["epoch 2: intra-op threads 1 -> 2 (1.9 of 2 cores idle, was 0.9)"]
    lowered = recheck(Sizing(threads=2, num_workers=None), _figures(0.9, epoch=3))
    assert lowered.sizing.threads == 1 and "2 -> 1 (0.9 of 2 cores idle)" in lowered.changes[0]


def test_recheck_does_not_flap_on_noise():
    sizing, previous = Sizing(threads=2, num_workers=1), None
    for epoch, idle in enumerate([1.9, 1.4, 1.8, 1.3, 1.7, 1.35, 1.95]):
        figures = _figures(idle, wait_frac=0.05, epoch=epoch, previous_idle=previous)
        result = recheck(sizing, figures)
        assert result.changes == [], (idle, result.changes)
        sizing, previous = result.sizing, idle
    assert sizing == Sizing(threads=2, num_workers=1)


def test_recheck_grows_workers_on_a_high_wait_up_to_the_free_cores():
    # 40% wait: a 4 ms wait per 6 ms compute with 0 workers -> 1 worker hides it; 2 cores idle.
    result = recheck(Sizing(threads=None, num_workers=0), _figures(2.0, wait_frac=0.4))
    assert result.sizing.num_workers == 1
    assert "workers 0 -> 1 (data wait 40% of step time > 20%" in result.changes[0]
    # Heavier wait, but only one core idle: 0 free for workers after the main process.
    busy = recheck(Sizing(threads=None, num_workers=0), _figures(1.0, wait_frac=0.8))
    assert busy.sizing.num_workers == 0 and busy.changes == []
    assert "no free core is left for another worker" in busy.notes[0]
    capped = recheck(Sizing(None, 0), _figures(2.0, wait_frac=0.9), max_workers=3)
    assert capped.sizing.num_workers == 3


def test_recheck_shrinks_oversubscribed_workers_only_with_slack():
    # Another process took a core since the last epoch (2.0 -> 1.0 idle).
    shrunk = recheck(Sizing(None, num_workers=2), _figures(1.0, 0.02, previous_idle=2.0))
    assert shrunk.sizing.num_workers == 0
    assert "workers 2 -> 0" in shrunk.changes[0]
    waiting = recheck(Sizing(None, num_workers=2), _figures(1.0, 0.15, previous_idle=2.0))
    assert waiting.sizing.num_workers == 2  # the loader has no slack: keep them
    steady = recheck(Sizing(None, num_workers=2), _figures(1.0, 0.02, previous_idle=1.2))
    assert steady.changes == []  # the load did not change: the count it kept up with stays
    none = recheck(Sizing(None, num_workers=0), _figures(0.0, 0.02, previous_idle=2.0))
    assert none.changes == [] and none.notes == []  # nothing to take away


def test_recheck_deepens_prefetch_for_bursty_waits_when_workers_cannot_grow():
    figures = _figures(1.0, wait_frac=0.5, wait_cv=1.2, batch_bytes=2**20, available_bytes=2**30)
    result = recheck(Sizing(None, num_workers=1, prefetch_factor=2), figures)
    assert result.sizing.prefetch_factor == 4 and "prefetch_factor 2 -> 4" in result.changes[0]
    no_memory = _figures(1.0, wait_frac=0.5, wait_cv=1.2, batch_bytes=2**20, available_bytes=2**20)
    assert recheck(Sizing(None, 1, 2), no_memory).sizing.prefetch_factor == 2
    steady = _figures(1.0, wait_frac=0.5, wait_cv=0.1, batch_bytes=2**20, available_bytes=2**30)
    assert recheck(Sizing(None, 1, 2), steady).sizing.prefetch_factor == 2


# ---- the meter and the start-up choice -------------------------------------------------------


class _Machine:
    """Cumulative busy/own CPU seconds that a test advances by hand."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def meter(self) -> LoadMeter:
        return LoadMeter(
            LoadReaders(lambda: self.busy, lambda: self.own, lambda: 2, lambda: self.t)
        )


def test_load_meter_separates_others_from_this_process_tree():
    machine = _Machine()
    meter = machine.meter()
    assert meter.read() is None  # not started
    meter.start()
    machine.run(10.0, others=0.5, own=1.2)
    load = meter.read()
    assert load.others_cores == pytest.approx(0.5) and load.own_cores == pytest.approx(1.2)
    assert load.idle_cores == pytest.approx(1.5) and load.window_s == pytest.approx(10.0)


def test_choose_threads_records_auto_choices_only(monkeypatch):
    machine = _Machine()
    monkeypatch.setattr(
        "fastdata.tune.load.time.sleep", lambda s: machine.run(s, others=1.0, own=0.0)
    )
    assert choose_threads("auto", 1, meter=machine.meter()) == 1
    assert load_module.last_thread_choice().load.idle_cores == pytest.approx(1.0)
    assert choose_threads(2, 1) == 2
    assert load_module.last_thread_choice() is None  # a fixed count is not followed


def test_real_load_meter_reads_this_machine():
    meter = LoadMeter()
    meter.start()
    # 50 ms of CPU of our own: the kernel counts CPU time in 10 ms ticks, and a fixed amount of
    # work can fall under one tick on a fast CPU (or a loaded one: seen here at 17 ms of wall).
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    load = meter.read()
    assert load is not None and 1 <= load.usable_cores
    assert load.own_cores > 0 and 0 <= load.idle_cores <= load.usable_cores


# ---- in a Lightning run: the monitor applies the re-check at each epoch end -------------------


class _ScriptedMeter:
    """A LoadMeter whose epoch readings are given: [others' cores in epoch 0, epoch 1, ...]."""

    def __init__(self, others: list[float]) -> None:
        self.others, self.epoch = others, -1

    def start(self) -> None:
        self.epoch += 1

    def read(self) -> CoreLoad:
        return CoreLoad(2, self.others[self.epoch], 1.0, 5.0)


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.threads_seen: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.threads_seen.append(torch.get_num_threads())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_monitor_sets_threads_each_epoch_from_the_measured_load(caplog):
    machine = _Machine()
    machine_meter = machine.meter()
    machine_meter.start()
    machine.run(1.0, others=1.0, own=0.0)
    load_module._LAST_CHOICE[:] = [load_module.ThreadChoice(1, 1, machine_meter.read())]
    torch.set_num_threads(1)  # what choose_threads("auto") chose with one core busy
    # epoch 0: the other process still holds a core; 1: it is gone; 2-3: noise; 4: back again.
    meter = _ScriptedMeter([1.0, 0.1, 0.5, 0.3, 1.0, 0.0])
    # threshold 0.99: this test is about threads; a jittery data wait must not add worker notes.
    monitor = LoaderMonitor(
        threshold=0.99, gpu_reader=None, energy_reader=lambda: None, load_meter=meter
    )
    data = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)) for _ in range(4)]
    model = _Model()
    trainer = quiet_trainer(
        max_epochs=6,
        callbacks=[monitor],
    )
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    assert model.threads_seen == [1, 1, 2, 2, 2, 1]
    actions = [h["action"] for h in monitor.history]
    assert actions[1] == "epoch 1: intra-op threads 1 -> 2 (1.9 of 2 cores idle, was 1.0)"
    assert actions[2] is None and actions[3] is None  # 1.5 and 1.7 idle: within the band
    assert actions[4] == "epoch 4: intra-op threads 2 -> 1 (1.0 of 2 cores idle, was 1.7)"
    assert "epoch 1: intra-op threads 1 -> 2" in caplog.text


def test_monitor_leaves_a_fixed_thread_count_alone():
    torch.set_num_threads(1)
    meter = _ScriptedMeter([0.0, 0.0])
    monitor = LoaderMonitor(
        threshold=0.99, gpu_reader=None, energy_reader=lambda: None, load_meter=meter
    )
    data = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)) for _ in range(3)]
    model = _Model()
    quiet_trainer(
        max_epochs=2,
        callbacks=[monitor],
    ).fit(model, train_dataloaders=DataLoader(data, batch_size=None))
    assert model.threads_seen == [1, 1]  # no choose_threads("auto") in this process


class _CountingMeter(_ScriptedMeter):
    def __init__(self) -> None:
        super().__init__([0.0] * 10)
        self.starts: list[int] = []

    def start(self) -> None:
        self.starts.append(self.model_steps())
        super().start()


def test_long_epochs_read_the_load_over_their_second_half():
    meter = _CountingMeter()
    monitor = LoaderMonitor(
        threshold=0.99, gpu_reader=None, energy_reader=lambda: None, load_meter=meter
    )
    data = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)) for _ in range(24)]
    trainer = quiet_trainer(
        callbacks=[monitor],
    )
    meter.model_steps = lambda: trainer.global_step
    trainer.fit(_Model(), train_dataloaders=DataLoader(data, batch_size=None))
    assert meter.starts == [0, 12]  # at the epoch's start, then again half-way


class _ResizableModule(pl.LightningDataModule):
    """Reports 2 workers (the loader itself runs in-process) and records resizes."""

    def __init__(self) -> None:
        super().__init__()
        self.num_workers, self.prefetch_factor, self.resized = 2, 2, []

    def train_dataloader(self):
        data = [(torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)) for _ in range(4)]
        return DataLoader(data, batch_size=None)

    def resize_workers(self, n: int, prefetch_factor: int | None = None) -> None:
        self.resized.append((n, prefetch_factor))
        self.num_workers = n


def test_monitor_takes_workers_away_when_another_process_takes_the_cores():
    dm = _ResizableModule()
    # epoch 0: quiet; 1: another process takes a core (idle 1.0: no core left for workers).
    meter = _ScriptedMeter([0.0, 1.0, 1.0])
    monitor = LoaderMonitor(
        threshold=0.99, gpu_reader=None, energy_reader=lambda: None, load_meter=meter
    )
    quiet_trainer(
        max_epochs=3,
        callbacks=[monitor],
    ).fit(_Model(), datamodule=dm)
    assert dm.resized == [(0, None)]  # once: epoch 2 measures the same and changes nothing
    actions = [h["action"] for h in monitor.history]
    assert actions[0] is None and actions[2] is None
    assert actions[1].startswith("epoch 1: workers 2 -> 0 (1.0 of 2 cores idle")
    assert actions[1].endswith(", from the next epoch")


def test_measured_loop_load_sizes_the_workers_both_ways():
    # 2 idle cores, a batch costs 60 ms to make, the loop computes 20 ms a step: 2 workers.
    up = recheck(
        Sizing(None, 1),
        _figures(2.0, 0.5, batch_cost_s=0.06, compute_s=0.02, wait_s=0.02),
    )
    assert up.sizing.num_workers == 2
    assert "workers 1 -> 2" in up.changes[0] and "2 workers keep up" in up.changes[0]
    # Another process takes a core: no core for a worker to overlap with; the wait is low.
    down = recheck(
        Sizing(None, 2),
        _figures(1.0, 0.05, batch_cost_s=0.06, compute_s=0.02, wait_s=0.001),
    )
    assert down.sizing.num_workers == 0 and "no second core" in down.changes[0]
    # The same target, but the wait is above the threshold: not lowered on a loader that lags;
    # one more worker is tried instead (the next epoch's throughput judges it).
    tried = recheck(
        Sizing(None, 2),
        _figures(1.0, 0.3, batch_cost_s=0.06, compute_s=0.02, wait_s=0.01, samples_per_s=100.0),
    )
    assert (
        tried.sizing.num_workers == 3
        and "tried: kept if the next epoch is faster" in (tried.changes[0])
    )
    assert tried.trial == Trial(2, 100.0)
    # A wait under half the threshold does not raise the count.
    calm = recheck(Sizing(None, 1), _figures(2.0, 0.05, batch_cost_s=0.06, compute_s=0.02))
    assert calm.sizing.num_workers == 1 and not calm.changes


class _CostlyBatches:
    """A loader whose batches come after 50 ms each and report 200 ms of read + decode (as the
    cpu backend's `last_stages` does): the loop computes a few ms, so it waits for data (and
    2 workers stay the answer even if a loaded machine makes the step take 100 ms)."""

    def __init__(self) -> None:
        self.last_stages = None

    def __len__(self) -> int:
        return 6

    def __iter__(self):
        for _ in range(6):
            time.sleep(0.05)
            self.last_stages = (0.05, 0.15)
            yield torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)


class _OneWorkerModule(_ResizableModule):
    def __init__(self) -> None:
        super().__init__()
        self.num_workers = 1

    def train_dataloader(self):
        return _CostlyBatches()


def test_monitor_sizes_workers_from_the_reported_batch_cost():
    dm = _OneWorkerModule()
    monitor = LoaderMonitor(
        gpu_reader=None, energy_reader=lambda: None, load_meter=_ScriptedMeter([0.0])
    )
    quiet_trainer(
        callbacks=[monitor],
    ).fit(_Model(), datamodule=dm)
    # 2 idle cores, a 200 ms batch against a step of a few ms: every idle core (floor(2)).
    assert dm.resized == [(2, None)]
    assert "workers 1 -> 2" in monitor.summary["action"]
    assert "a batch costs 200.0 ms" in monitor.summary["action"]


def test_a_worker_change_is_judged_by_the_next_epoch():
    figures = {"batch_cost_s": 0.06, "compute_s": 0.02, "wait_s": 0.01}
    # 0 -> 1 was tried at 100 samples/s; the epoch with 1 worker ran 80: undone, not retried.
    slower = recheck(
        Sizing(None, 1),
        _figures(1.0, 0.4, samples_per_s=80.0, trial=Trial(0, 100.0), **figures),
    )
    assert slower.sizing.num_workers == 0 and slower.lost == frozenset({1})
    assert "1 workers ran 80 samples/s, 0 ran 100: undone" in slower.changes[0]
    again = recheck(
        Sizing(None, 0), _figures(1.0, 0.4, samples_per_s=100.0, lost=slower.lost, **figures)
    )
    assert again.sizing.num_workers == 0 and not again.changes and again.notes
    # The epoch with 1 worker ran 150: kept, and (the wait still high) 2 are tried next.
    faster = recheck(
        Sizing(None, 1),
        _figures(1.0, 0.4, samples_per_s=150.0, trial=Trial(0, 100.0), **figures),
    )
    assert faster.sizing.num_workers == 2 and faster.trial == Trial(1, 150.0)
    assert "1 workers kept (150 samples/s, 0 workers ran 100)" in faster.notes[0]
    assert faster.lost == frozenset({0})  # the model's "0 workers" is not gone back to
    # Kept with a gain within the noise (< CLIMB_GAIN) and a low wait: the count stays.
    calm = recheck(
        Sizing(None, 1),
        _figures(1.0, 0.1, samples_per_s=103.0, trial=Trial(0, 100.0), **figures),
    )
    assert calm.sizing.num_workers == 1 and not calm.changes
    # Another load (idle cores moved by more than 0.75): the lost counts are forgotten.
    moved = recheck(
        Sizing(None, 1), _figures(2.0, 0.1, lost=frozenset({0, 2}), previous_idle=1.0, **figures)
    )
    assert moved.lost == frozenset()


def test_a_gaining_change_climbs_to_the_best_count_and_stops_one_past_it():
    """With a low wait, a kept change that gained more than CLIMB_GAIN tries one more step the
    same way; the step past the best count loses and is undone (a core taken by another process:
    more runnable workers win a larger share of it, which the wait does not show)."""
    figures = {"batch_cost_s": 0.04, "compute_s": 0.03, "wait_s": 0.002}
    rates = {0: 570.0, 1: 620.0, 2: 680.0, 3: 735.0, 4: 670.0}
    sizing, trial, lost, path = Sizing(None, 1), Trial(0, rates[0]), frozenset(), [1]
    for _ in range(8):
        workers = sizing.num_workers
        out = recheck(
            sizing,
            _figures(1.0, 0.05, samples_per_s=rates[workers], trial=trial, lost=lost, **figures),
        )
        sizing, trial, lost = out.sizing, out.trial, out.lost
        if sizing.num_workers == workers:
            break
        path.append(sizing.num_workers)
    assert path == [1, 2, 3, 4, 3]
    assert sizing.num_workers == 3 and 4 in lost
    # Downwards too: 3 -> 2 kept with a gain tries 1; 1 is slower and undone.
    down = recheck(
        Sizing(None, 2), _figures(1.0, 0.05, samples_per_s=700.0, trial=Trial(3, 600.0), **figures)
    )
    assert down.sizing.num_workers == 1 and down.trial == Trial(2, 700.0)
    # Never past max_workers, nor to a count that lost.
    capped = recheck(
        Sizing(None, 2),
        _figures(1.0, 0.05, samples_per_s=700.0, trial=Trial(1, 600.0), **figures),
        max_workers=2,
    )
    assert capped.sizing.num_workers <= 2 and not any("gained" in c for c in capped.changes)
    # Each rank climbs on its own: at most twice its share of the cores (8 ranks on 16 cores: 4).
    many = CoreLoad(usable_cores=16, others_cores=0.0, own_cores=8.0, window_s=10.0)
    shared = recheck(
        Sizing(None, 4),
        replace(
            _figures(1.0, 0.05, samples_per_s=700.0, trial=Trial(3, 600.0), **figures), load=many
        ),
        ranks_per_node=8,
    )
    assert not any("gained" in c for c in shared.changes) and shared.sizing.num_workers <= 4
    barred = recheck(
        Sizing(None, 2),
        _figures(
            1.0, 0.05, samples_per_s=700.0, trial=Trial(1, 600.0), lost=frozenset({3}), **figures
        ),
    )
    assert barred.sizing.num_workers != 3 and not any("gained" in c for c in barred.changes)
