"""`ShardDataModule`'s options: keyword-only after `root`, and grouped (`fastdata.lightning.options`) the
way MosaicML Streaming groups its own: a `ShardSet` per dataset with its weight, worker and cache
settings as dataclasses, beside the flat keywords (which keep working)."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from fastdata import CacheSettings, ShardDataModule, ShardSet, WorkerSettings
from fastdata.write import ShardOptions, write_shards
from fastdata.write.sources.arrays import ArraySource

CPU = torch.device("cpu")


def _write(out: Path, prefix: str, n_train: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    splits = {
        "train": (rng.integers(0, 256, (n_train, 4, 4, 3), dtype=np.uint8), np.arange(n_train)),
        "test": (rng.integers(0, 256, (8, 4, 4, 3), dtype=np.uint8), np.arange(8)),
    }
    classes = [f"{prefix}{i}" for i in range(n_train)]
    write_shards(ArraySource(splits, classes), out, ShardOptions(max_count=16, progress=False))
    return out


@pytest.fixture(scope="module")
def two_roots(tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("options")
    return [_write(base / "a", "a", 40, 1), _write(base / "b", "b", 24, 2)]


def _epoch(dm: ShardDataModule) -> list[int]:
    """One training epoch's labels (merged class indices), in order."""
    dm.setup("fit")
    labels = []
    for batch in dm.train_dataloader():
        _, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, CPU, 0), 0)
        labels += y.tolist()
    return labels


COMMON = {"batch_size": 8, "backend": "cpu", "num_workers": 0, "seed": 3, "drop_last": False}


# ------------------------------------------------------------------ keyword-only


def test_arguments_after_root_are_keyword_only(tiny_shards):
    with pytest.raises(TypeError, match="positional argument"):
        ShardDataModule(tiny_shards, 16)  # type: ignore[misc]
    assert ShardDataModule(tiny_shards, batch_size=16).batch_size == 16
    assert ShardDataModule(root=tiny_shards, batch_size=16).roots == [str(tiny_shards)]


# ------------------------------------------------------------------ ShardSet


def test_shardsets_weigh_a_mix_exactly_as_weights_do(two_roots):
    a, b = two_roots
    by_sets = ShardDataModule([ShardSet(a, weight=3), ShardSet(b)], **COMMON)
    by_weights = ShardDataModule([a, b], weights=[3, 1], **COMMON)
    assert by_sets.weights == [3.0, 1.0] and by_sets.roots == [str(a), str(b)]
    sets_epoch = _epoch(by_sets)
    assert sets_epoch == _epoch(by_weights)
    # 64 samples drawn 3:1 -> 48 from a (classes 0..39), 16 from b (classes 40..63).
    assert sum(label < 40 for label in sets_epoch) == 48 and len(sets_epoch) == 64
    # Plain roots in the list weigh 1.0 beside ShardSets.
    assert ShardDataModule([ShardSet(a, weight=2.5), b], **COMMON).weights == [2.5, 1.0]


def test_a_lone_shardset_is_its_root(tiny_shards):
    dm = ShardDataModule(ShardSet(tiny_shards), batch_size=16)
    assert dm.roots == [str(tiny_shards)] and not dm.mixed and dm.weights is None
    with pytest.raises(ValueError, match=r"alone is no mix.*pass a list"):
        ShardDataModule(ShardSet(tiny_shards, weight=2), batch_size=16)


def test_shardset_weights_and_weights_keyword_are_refused_together(two_roots):
    a, b = two_roots
    with pytest.raises(ValueError, match=r"weights=\[1, 2\] and the ShardSets' weights"):
        ShardDataModule([ShardSet(a), ShardSet(b)], weights=[1, 2])


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_bad_shardset_weight_names_the_root(weight):
    with pytest.raises(ValueError, match=r"ShardSet\('shards/x'\) weight must be"):
        ShardSet("shards/x", weight=weight)


def test_shardset_weight_is_keyword_only():
    with pytest.raises(TypeError):
        ShardSet("shards/x", 2.0)  # type: ignore[misc]


# ------------------------------------------------------------------ workers=


def test_worker_settings_stand_for_the_flat_keywords(tiny_shards):
    group = WorkerSettings(
        num_workers=0, prefetch_factor=3, decode_threads=2, timeout=42.0, mp_context="spawn"
    )
    grouped = ShardDataModule(tiny_shards, batch_size=16, backend="cpu", workers=group)
    flat = ShardDataModule(
        tiny_shards,
        batch_size=16,
        backend="cpu",
        num_workers=0,
        prefetch_factor=3,
        decode_threads=2,
        loader_timeout=42.0,
        mp_context="spawn",
    )
    names = ("num_workers", "prefetch_factor", "decode_threads", "loader_timeout", "mp_context")
    assert [getattr(grouped, n) for n in names] == [getattr(flat, n) for n in names]
    assert [getattr(grouped, n) for n in names] == [0, 3, 2, 42.0, "spawn"]
    assert grouped.loader_spec("train", True).workers == flat.loader_spec("train", True).workers


def test_worker_settings_carry_pinning_and_persistence(tiny_shards):
    group = WorkerSettings(num_workers=1, pin_memory=False, persistent_workers=False)
    dm = ShardDataModule(tiny_shards, batch_size=16, backend="cpu", workers=group)
    spec = dm.loader_spec("train", True).workers
    assert (spec.num_workers, spec.pin_memory, spec.persistent_workers) == (1, False, False)


@pytest.mark.parametrize(
    "flat, field",
    [
        ({"num_workers": 2}, "num_workers"),
        ({"prefetch_factor": 4}, "prefetch_factor"),
        ({"decode_threads": "auto"}, "decode_threads"),
        ({"loader_timeout": 5.0}, "timeout"),
        ({"mp_context": "fork"}, "mp_context"),
    ],
)
def test_a_group_and_its_flat_keyword_are_an_error_naming_both(tiny_shards, flat, field):
    ((keyword, value),) = flat.items()
    with pytest.raises(ValueError) as info:
        ShardDataModule(tiny_shards, workers=WorkerSettings(), **flat)
    message = str(info.value)
    assert "workers=WorkerSettings(" in message and f"{keyword}={value!r}" in message
    assert f"WorkerSettings.{field}" in message


def test_cache_settings_stand_for_cache_dir_and_limit(tmp_path):
    url = "http://127.0.0.1:9/dataset"  # nothing is fetched before setup
    grouped = ShardDataModule(url, cache=CacheSettings(dir=tmp_path, limit="2GB"))
    flat = ShardDataModule(url, cache_dir=tmp_path, cache_limit="2GB")
    assert (grouped.cache_dir, grouped.cache_limit) == (str(tmp_path), "2GB")
    pytest.importorskip("fsspec")
    cache = grouped._shard_cache()
    assert cache.cache_dir == flat._shard_cache().cache_dir == tmp_path
    assert cache.limit_bytes == 2 * 10**9
    with pytest.raises(ValueError, match=r"cache=CacheSettings\(.*\) and cache_limit='1GB'"):
        ShardDataModule(url, cache=CacheSettings(dir=tmp_path), cache_limit="1GB")


def test_a_group_of_the_wrong_type_names_the_type(tiny_shards):
    with pytest.raises(TypeError, match=r"workers= must be a fastdata.read.base.WorkerSettings"):
        ShardDataModule(tiny_shards, workers={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"cache= must be a fastdata.lightning.options.CacheSettings"
    ):
        ShardDataModule(tiny_shards, cache=WorkerSettings())  # type: ignore[arg-type]


def test_flat_keywords_keep_working_without_a_warning(tiny_shards, caplog, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="fastdata"):
            dm = ShardDataModule(
                tiny_shards,
                batch_size=16,
                num_workers=0,
                prefetch_factor=2,
                decode_threads=1,
                cache_dir=tmp_path,
                cache_limit="1GB",
                loader_timeout=30,
            )
    assert not caplog.records and dm.workers is None
    assert (dm.num_workers, dm.cache_limit, dm.loader_timeout) == (0, "1GB", 30)


# ------------------------------------------------------------------ Lightning


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4 * 4 * 3, 64)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1).float()), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SavingModule(ShardDataModule):
    """A user's subclass that records its arguments (`save_hyperparameters`)."""

    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.save_hyperparameters()


def test_groups_survive_save_hyperparameters_and_a_checkpoint(two_roots, tmp_path):
    """A checkpoint holding the groups (what a Trainer writes for a module that called
    `save_hyperparameters`) loads with torch's default `weights_only=True`, and
    `load_from_checkpoint` rebuilds a module with the same settings."""
    a, b = two_roots
    dm = _SavingModule(
        [ShardSet(a, weight=3), ShardSet(b)],
        batch_size=8,
        backend="cpu",
        train_transforms="none",
        workers=WorkerSettings(num_workers=0, decode_threads=2),
        cache=CacheSettings(limit="1GB"),
    )
    assert dm.hparams["workers"] == WorkerSettings(num_workers=0, decode_threads=2)
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Linear(), datamodule=dm)
    path = next(tmp_path.rglob("*.ckpt"))
    assert "datamodule_hyper_parameters" in torch.load(path, weights_only=True)
    again = _SavingModule.load_from_checkpoint(path)
    assert again.roots == dm.roots and again.weights == [3.0, 1.0]
    assert again.workers == dm.workers and again.decode_threads == 2
    assert again.cache_limit == "1GB" and again.batch_size == 8


def test_lightning_cli_takes_shardsets_and_groups(two_roots, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI

    class Model(LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()

    monkeypatch.setattr(sys, "argv", ["train.py"])
    a, b = two_roots
    root = json.dumps([asdict(ShardSet(a, weight=3)), str(b)])
    args = [
        f"--data.root={root}",
        "--data.workers.num_workers=0",
        "--data.workers.decode_threads=2",
        "--data.cache.limit=1GB",
        "--trainer.logger=false",
    ]
    cli = LightningCLI(Model, ShardDataModule, args=args, run=False, save_config_callback=None)
    dm = cli.datamodule
    assert dm.roots == [str(a), str(b)] and dm.weights == [3.0, 1.0]
    assert dm.workers == WorkerSettings(num_workers=0, decode_threads=2)
    assert (dm.num_workers, dm.decode_threads, dm.cache_limit) == (0, 2, "1GB")
    plain = LightningCLI(
        Model, ShardDataModule, args=[f"--data.root={a}"], run=False, save_config_callback=None
    )
    assert plain.datamodule.roots == [str(a)] and plain.datamodule.workers is None
