"""Worker lifecycle: one set of workers per split, prompt teardown, death with the parent, timeouts."""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
import torch

from fastdata import ShardDataModule
from fastdata.read import WorkerSettings
from fastdata.read.backends.cpu import LoaderTimeoutError
from fastdata.read.backends.cpu_batches import ShardBatchDataset
from fastdata.tune.sizing import LoaderSettings
from tests.lightning.test_datamodule import SmallCNN

REPO = Path(__file__).resolve().parents[2]


_BEFORE: set[int] = set()  # processes this test did not start (servers, an earlier test's)


@pytest.fixture(autouse=True)
def _only_this_tests_processes():
    """Count only the processes a test starts: collect earlier tests' garbage (their
    DataModules' finalizers stop their workers), then leave out whatever is still running."""
    gc.collect()
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))
    yield
    _BEFORE.clear()


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in _BEFORE]


def _dm(root: Path, **kw) -> ShardDataModule:
    """A cpu-backend module; `WorkerSettings` fields among `kw` (default: 2 workers) go there."""
    fields = {"num_workers": 2, "prefetch_factor": 2}
    fields |= {k: kw.pop(k) for k in list(kw) if k in WorkerSettings.__dataclass_fields__}
    return ShardDataModule(
        root, batch_size=32, backend="cpu", workers=WorkerSettings(**fields), **kw
    )


def test_train_dataloader_every_epoch_keeps_processes_and_rss_flat(tiny_shards):
    dm = _dm(tiny_shards)
    counts, rss = [], []
    for _ in range(20):  # a custom loop, a notebook or reload_dataloaders_every_n_epochs=1
        loader = dm.train_dataloader()  # the last one is still held: its workers persist
        assert sum(len(y) for _, y in loader) == 288
        children = _children()
        counts.append(len(children))
        rss.append(sum(p.memory_info().rss for p in children) + psutil.Process().memory_info().rss)
    assert counts == [2] * 20  # the previous loader's workers were stopped, not left behind
    # Flat memory: the last epoch's processes hold no more than the third's, plus slack for
    # allocator noise (a leaked pair of workers is ~2 x 100+ MiB).
    assert rss[-1] - rss[2] < 64 * 2**20, [r // 2**20 for r in rss]


class _CountWorkers(pl.Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.counts.append(len(_children()))


def test_trainer_reloading_loaders_every_epoch_keeps_one_set_of_workers(tiny_shards):
    count = _CountWorkers()
    trainer = pl.Trainer(
        max_epochs=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2,
        limit_val_batches=0, reload_dataloaders_every_n_epochs=1, callbacks=[count],
    )  # fmt: skip
    trainer.fit(SmallCNN(300), datamodule=_dm(tiny_shards))
    assert count.counts == [2, 2, 2, 2]
    assert _children() == []  # Lightning's teardown stopped them


def test_teardown_and_collection_stop_workers_within_a_second(tiny_shards):
    dm = _dm(tiny_shards)
    for _ in range(3):
        train = dm.train_dataloader()
        next(iter(train))
    val = _dm(tiny_shards, splits={"val": "test"})
    val_loader = val.val_dataloader()
    next(iter(val_loader))
    workers = _children()
    assert len(workers) == 4  # one set per DataModule and split

    start = time.monotonic()
    dm.teardown("fit")
    assert time.monotonic() - start < 1.0
    assert len(_children()) == 2
    assert sum(len(y) for _, y in train) == 288  # still usable: iterating starts workers again

    start = time.monotonic()
    del dm, train, val, val_loader
    gc.collect()
    assert time.monotonic() - start < 1.0
    assert _children() == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


def test_workers_persist_whatever_the_tuner_measured_for_another_count(tiny_shards, monkeypatch):
    # prefetch_factor="auto" asks the tuner; under load at start-up it may find 0 workers best.
    # The 2 workers asked for must still persist between epochs.
    measured = LoaderSettings(
        num_workers=0, prefetch_factor=2, decode_threads=1, pin_memory=False,
        persistent_workers=False, reasons=["test: 0 workers measured best"],
    )  # fmt: skip
    monkeypatch.setattr("fastdata.lightning.runtime.auto_settings", lambda *a, **k: measured)
    dm = _dm(tiny_shards, prefetch_factor="auto")
    loader = dm.train_dataloader()
    assert loader.loader.dataloader.num_workers == 2
    assert loader.loader.dataloader.persistent_workers
    first = [len(y) for _, y in loader]
    pids = {p.pid for p in _children()}
    assert [len(y) for _, y in loader] == first
    assert {p.pid for p in _children()} == pids and len(pids) == 2  # the same 2 processes


def test_default_loader_timeout_is_bounded():
    assert 0 < WorkerSettings().timeout <= 3600
    assert 0 < ShardDataModule("unused").workers.timeout <= 3600


def test_a_stalled_worker_times_out_with_an_error_naming_worker_and_split(tiny_shards, monkeypatch):
    load = ShardBatchDataset._load_batch

    def stall(self, reader, plan, number, skips):  # batch 1 never arrives (worker 1)
        if number == 1:
            time.sleep(60)
        return load(self, reader, plan, number, skips)

    monkeypatch.setattr(ShardBatchDataset, "_load_batch", stall)
    dm = _dm(tiny_shards, timeout=2.0, mp_context="fork")
    loader = dm.train_dataloader()
    with pytest.raises(
        LoaderTimeoutError, match=r"worker 1 of the 'train' loader .*WorkerSettings.timeout"
    ):
        for _ in loader:
            pass
    loader.close()
    assert _children() == []


_PARENT = textwrap.dedent(
    """
    import sys, threading, time
    import psutil
    from fastdata import ShardDataModule, WorkerSettings
    from fastdata.read.backends.cpu_batches import ShardBatchDataset

    load = ShardBatchDataset._load_batch

    def stuck(self, reader, plan, number, skips):  # a read that never returns
        if number >= 2:
            time.sleep(3600)
        return load(self, reader, plan, number, skips)

    ShardBatchDataset._load_batch = stuck
    dm = ShardDataModule(
        sys.argv[1], batch_size=32, backend="cpu",
        workers=WorkerSettings(num_workers=2, prefetch_factor=2, mp_context="fork", timeout=0),
    )

    def run():
        batches = iter(dm.train_dataloader())
        next(batches), next(batches)  # both workers started; now stuck on batches 2 and 3
        pids = [p.pid for p in psutil.Process().children()]
        print("WORKERS", *pids, flush=True)
        time.sleep(3600)

    if sys.argv[2] == "main":
        run()
    else:  # no parent-death signal (it follows the starting thread): the watchdog alone
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    """
)


@pytest.mark.parametrize("thread", ["main", "thread"])
def test_workers_exit_when_the_training_process_is_killed(tiny_shards, tmp_path, thread):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with (tmp_path / "stderr").open("w") as stderr:  # the child keeps its own copy
        parent = subprocess.Popen(
            [sys.executable, str(script), str(tiny_shards), thread],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        )  # fmt: skip
    workers: list[psutil.Process] = []
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the training process did not start its workers within 120 s"
        line = parent.stdout.readline()
        assert line.startswith("WORKERS"), (tmp_path / "stderr").read_text()
        workers = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert len(workers) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        _gone, alive = psutil.wait_procs(workers, timeout=15)
        assert alive == [], f"workers outlived their parent: {alive}"
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()
        for worker in workers:
            if worker.is_running():
                worker.kill()


def test_loader_is_usable_after_close(tiny_shards):
    dm = _dm(tiny_shards, num_workers=1)
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    loader.close()
    assert _children() == []
    with pytest.raises(StopIteration):  # the interrupted iteration ended with its workers
        next(batches)
    labels = torch.cat([y for _, y in loader])
    assert len(labels) == 288 and len(_children()) == 1
    loader.close()


def test_a_module_with_loaders_still_pickles_and_its_copy_stops_its_own_workers(tiny_shards):
    dm = _dm(tiny_shards, num_workers=0)
    dm.train_dataloader()
    copy = pickle.loads(pickle.dumps(dm))  # e.g. a launcher sending the module to processes
    loader = copy.train_dataloader()
    assert loader.owner is copy and sum(len(y) for _, y in loader) == 288


def test_a_loader_outlives_a_temporary_datamodule_and_stops_its_workers_when_dropped(tiny_shards):
    loader = _dm(tiny_shards).train_dataloader()  # nothing else holds the DataModule
    assert sum(len(y) for _, y in loader) == 288
    workers = _children()
    assert len(workers) == 2  # persistent between epochs
    assert sum(len(y) for _, y in loader) == 288
    start = time.monotonic()
    del loader  # no cycle: collected at once, and its workers stopped with it (no gc.collect())
    assert time.monotonic() - start < 1.0
    assert _children() == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


class _AskForLoadersMidEpoch(pl.Callback):
    """Reads `len(train_dataloader())` mid-epoch (as some callbacks do) and counts batches."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        if trainer.current_epoch == 0 and batch_idx == 1:
            assert len(trainer.datamodule.train_dataloader()) == 9
            trainer.datamodule.predict_dataloader()  # its own slot: closes no other loader


def test_a_loader_asked_for_mid_epoch_does_not_end_the_running_epoch(tiny_shards):
    ask = _AskForLoadersMidEpoch()
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[ask],
    )  # fmt: skip
    trainer.fit(SmallCNN(300), datamodule=_dm(tiny_shards))
    assert ask.batches == 2 * 9  # 288 samples / 32 a batch, both epochs whole
    assert _children() == []  # the replaced loader's workers stopped when its epoch ended
