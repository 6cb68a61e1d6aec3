"""`ShardDataModule`'s options: keyword-only after `root`, one public way each, grouped
(`fastdata.lightning.options`) the way MosaicML Streaming groups its own where an option carries
several values: a `ShardSet` per dataset with its weight, worker and cache settings as
dataclasses."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from fastdata import CacheSettings, ShardDataModule, ShardSet, WorkerSettings
from fastdata.lightning.options import AUTO_WORKERS
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


COMMON = {
    "batch_size": 8,
    "backend": "cpu",
    "workers": WorkerSettings(num_workers=0),
    "seed": 3,
    "drop_last": False,
}


# ------------------------------------------------------------------ keyword-only


def test_arguments_after_root_are_keyword_only(tiny_shards):
    with pytest.raises(TypeError, match="positional argument"):
        ShardDataModule(tiny_shards, 16)  # type: ignore[misc]
    assert ShardDataModule(tiny_shards, batch_size=16).batch_size == 16
    assert ShardDataModule(root=tiny_shards, batch_size=16).roots == [str(tiny_shards)]


# ------------------------------------------------------------------ ShardSet


def test_shardsets_weigh_a_mix(two_roots):
    a, b = two_roots
    by_sets = ShardDataModule([ShardSet(a, weight=3), ShardSet(b)], **COMMON)
    assert by_sets.weights == [3.0, 1.0] and by_sets.roots == [str(a), str(b)]
    sets_epoch = _epoch(by_sets)
    # 64 samples drawn 3:1 -> 48 from a (classes 0..39), 16 from b (classes 40..63).
    assert sum(label < 40 for label in sets_epoch) == 48 and len(sets_epoch) == 64
    # Plain roots in the list weigh 1.0 beside ShardSets.
    assert ShardDataModule([ShardSet(a, weight=2.5), b], **COMMON).weights == [2.5, 1.0]


def test_a_lone_shardset_is_its_root(tiny_shards):
    dm = ShardDataModule(ShardSet(tiny_shards), batch_size=16)
    assert dm.roots == [str(tiny_shards)] and not dm.mixed and dm.weights is None
    with pytest.raises(ValueError, match=r"alone is no mix.*pass a list"):
        ShardDataModule(ShardSet(tiny_shards, weight=2), batch_size=16)


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_bad_shardset_weight_names_the_root(weight):
    with pytest.raises(ValueError, match=r"ShardSet\('shards/x'\) weight must be"):
        ShardSet("shards/x", weight=weight)


def test_shardset_weight_is_keyword_only():
    with pytest.raises(TypeError):
        ShardSet("shards/x", 2.0)  # type: ignore[misc]


# ------------------------------------------------------------------ workers=


def test_worker_settings_reach_the_loader_as_given(tiny_shards):
    group = WorkerSettings(
        num_workers=0, prefetch_factor=3, decode_threads=2, timeout=42.0, mp_context="spawn"
    )
    dm = ShardDataModule(tiny_shards, batch_size=16, backend="cpu", workers=group)
    assert dm.workers == group
    assert dm.loader_spec("train", True).workers == group


def test_worker_settings_carry_pinning_and_persistence(tiny_shards):
    group = WorkerSettings(num_workers=1, pin_memory=False, persistent_workers=False)
    dm = ShardDataModule(tiny_shards, batch_size=16, backend="cpu", workers=group)
    spec = dm.loader_spec("train", True).workers
    assert (spec.num_workers, spec.pin_memory, spec.persistent_workers) == (1, False, False)


def test_auto_counts_are_measured_and_the_given_settings_kept(tiny_shards, monkeypatch):
    """`workers=None` measures both counts; "auto" in a group measures that count only, and
    the group's pinning stands (the tuner's verdict fills only what was not given)."""
    import fastdata.lightning.runtime as runtime_module
    from fastdata.tune.sizing import LoaderSettings

    asked = []

    def fake_auto(spec, backend="cpu", ranks_per_node=None, decode_threads=1):
        asked.append(decode_threads)
        return LoaderSettings(3, 5, True, True, decode_threads=1)

    monkeypatch.setattr(runtime_module, "auto_settings", fake_auto)
    default = ShardDataModule(tiny_shards, backend="cpu").loader_spec("train", True).workers
    assert (default.num_workers, default.prefetch_factor, default.pin_memory) == (3, 5, True)
    group = WorkerSettings(num_workers=2, prefetch_factor="auto", pin_memory=False, timeout=9)
    dm = ShardDataModule(tiny_shards, backend="cpu", workers=group)
    spec = dm.loader_spec("train", True).workers
    assert (spec.num_workers, spec.prefetch_factor) == (2, 5)
    assert (spec.pin_memory, spec.timeout) == (False, 9) and len(asked) == 2


@pytest.mark.parametrize(
    "group, match",
    [
        (WorkerSettings(num_workers=-1), "WorkerSettings.num_workers must be an int >= 0"),
        (WorkerSettings(prefetch_factor="many"), "WorkerSettings.prefetch_factor must be"),
        (WorkerSettings(timeout=-1), "WorkerSettings.timeout must be >= 0"),
    ],
)
def test_a_bad_worker_setting_is_named(tiny_shards, group, match):
    with pytest.raises(ValueError, match=match):
        ShardDataModule(tiny_shards, workers=group)


def test_cache_settings_make_the_shard_cache(tmp_path):
    url = "http://127.0.0.1:9/dataset"  # nothing is fetched before setup
    dm = ShardDataModule(url, cache=CacheSettings(dir=tmp_path, limit="2GB"))
    assert dm.cache == CacheSettings(dir=str(tmp_path), limit="2GB")
    pytest.importorskip("fsspec")
    cache = dm._shard_cache()
    assert cache.cache_dir == tmp_path and cache.limit_bytes == 2 * 10**9


def test_the_cache_environment_fills_what_cache_settings_leave_none(tmp_path, monkeypatch):
    """$FASTDATA_CACHE_DIR / $FASTDATA_CACHE_LIMIT are the values where none is given, for a
    `CacheSettings` field left None too (the limit was the built-in 50 GB there)."""
    pytest.importorskip("fsspec")
    monkeypatch.setenv("FASTDATA_CACHE_LIMIT", "3GB")
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "env"))
    url = "http://127.0.0.1:9/dataset"
    by_dir = ShardDataModule(url, cache=CacheSettings(dir=tmp_path))._shard_cache()
    assert by_dir.cache_dir == tmp_path and by_dir.limit_bytes == 3 * 10**9
    by_limit = ShardDataModule(url, cache=CacheSettings(limit="1GB"))._shard_cache()
    assert by_limit.cache_dir == tmp_path / "env" and by_limit.limit_bytes == 10**9
    assert ShardDataModule(url)._shard_cache() is None  # the reader's own default: the same


def test_a_group_of_the_wrong_type_names_the_type(tiny_shards):
    with pytest.raises(TypeError, match=r"workers= must be a fastdata.read.base.WorkerSettings"):
        ShardDataModule(tiny_shards, workers={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"cache= must be a fastdata.lightning.options.CacheSettings"
    ):
        ShardDataModule(tiny_shards, cache=WorkerSettings())  # type: ignore[arg-type]


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
    assert again.workers == dm.workers and again.workers.decode_threads == 2
    assert again.cache.limit == "1GB" and again.batch_size == 8


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
        "--data.workers.prefetch_factor=auto",
        "--data.cache.limit=1GB",
        "--trainer.logger=false",
    ]
    cli = LightningCLI(Model, ShardDataModule, args=args, run=False, save_config_callback=None)
    dm = cli.datamodule
    assert dm.roots == [str(a), str(b)] and dm.weights == [3.0, 1.0]
    assert dm.workers == WorkerSettings(num_workers=0, decode_threads=2, prefetch_factor="auto")
    assert dm.cache == CacheSettings(limit="1GB")
    plain = LightningCLI(
        Model, ShardDataModule, args=[f"--data.root={a}"], run=False, save_config_callback=None
    )
    assert plain.datamodule.roots == [str(a)] and plain.datamodule.workers == AUTO_WORKERS
