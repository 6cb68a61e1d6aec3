"""Where the DataModule's loaders run: worker options reach the cpu backend's DataLoader."""

from __future__ import annotations

import pytest

from fastdata import ShardDataModule, WorkerSettings
from fastdata.lightning.runtime import rank_and_world


def test_loader_timeout_and_start_method_reach_the_dataloader(tiny_shards):
    dm = ShardDataModule(
        tiny_shards,
        backend="cpu",
        batch_size=50,
        workers=WorkerSettings(num_workers=1, prefetch_factor=2, timeout=30.0, mp_context="spawn"),
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    dataloader = loader.loader.dataloader
    assert dataloader.timeout == 30.0
    assert dataloader.multiprocessing_context.get_start_method() == "spawn"
    assert sum(len(y) for _, y in loader) == 300  # spawned workers load the whole epoch


def test_bad_timeout_and_explicit_ranks():
    with pytest.raises(ValueError, match="WorkerSettings.timeout must be >= 0"):
        ShardDataModule("unused", workers=WorkerSettings(timeout=-1))
    assert rank_and_world(1, 4, None) == (1, 4)
    assert rank_and_world(None, None, None) == (0, 1)
