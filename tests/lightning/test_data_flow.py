"""Data flows one way between `ShardDataModule` and its loaders (issue 26): the module hands a
loader what it needs and asks it what it did; a loader calls nothing of the module's."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import fastdata.lightning.datamodule as datamodule_module
import fastdata.lightning.epoch_loader as epoch_loader_module
from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.lightning.epoch_loader import EpochLoader, EpochPosition, TrainBatch
from fastdata.read import LoaderSpec, get_backend


def _foreign_privates(module) -> list[str]:
    """Every ``x._name`` (and ``getattr(x, "_name")``) in `module` whose ``x`` is not ``self``."""
    tree = ast.parse(Path(module.__file__).read_text())
    found = []
    for node in ast.walk(tree):
        name, owner = None, None
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name, owner = node.args[1].value, node.args[0]
        private = name is not None and name.startswith("_") and not name.startswith("__")
        if private and ast.unparse(owner) not in ("self", "cls"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_loader_and_the_module_touch_no_private_of_each_other():
    # Before: EpochLoader called owner._start_epoch, owner._pending_len and owner._yielded.
    assert _foreign_privates(epoch_loader_module) == []
    assert _foreign_privates(datamodule_module) == []


def test_a_loader_starts_its_own_epochs_with_no_datamodule(tiny_shards: Path):
    """Its holder need only have a ``trainer`` (None: epochs 0, 1, 2, ... counted on the loader's
    position), so a loader runs epochs with no DataModule behind it; a position handed to the
    next loader carries on there."""
    spec = LoaderSpec(load_manifest(tiny_shards), "train", train=True, batch_size=32, seed=3)
    factory, holder = get_backend("cpu").load(), SimpleNamespace(trainer=None)
    loader = EpochLoader(holder, spec, factory)
    assert loader.train and isinstance(loader.position, EpochPosition)
    epochs = [[y.tolist() for _, y in loader] for _ in range(2)]
    assert loader.position.epoch == 1 and len(epochs[0]) == len(epochs[1]) == len(loader) == 10
    assert epochs[0] != epochs[1]  # reshuffled: the loader counted the epoch itself
    following = EpochLoader(holder, spec, factory, loader.position)
    batches = list(following)
    assert all(isinstance(b, TrainBatch) for b in batches)
    assert loader.position.epoch == 2 and [b[1].tolist() for b in batches] not in epochs
    fresh = EpochLoader(holder, spec, factory)  # a position of its own: epoch 0 again
    assert [y.tolist() for _, y in fresh] == epochs[0]
    evaluation = EpochLoader(holder, replace(spec, split="test", train=False), factory)
    assert evaluation.position is None and not evaluation.train


def test_the_module_asks_its_loaders_which_yielded_last(tiny_shards: Path):
    """A batch whose type was lost (a plain tuple) gets the transforms of the mode of the loader
    that yielded last, asked of the loaders themselves; a batch that outlives its loader still
    gets what the last loader made for its mode said of its batches."""
    dm = ShardDataModule(
        tiny_shards,
        batch_size=32,
        workers=WorkerSettings(num_workers=0),
        backend="cpu",
        splits={"val": "test"},
    )
    train, val = dm.train_dataloader(), dm.val_dataloader()
    val_x, val_y = next(iter(val))
    x, y = next(iter(train))
    assert train.yielded > val.yielded > 0 and train.started > val.started > 0
    assert dm._is_training((x, y))  # the training loader yielded last
    next(iter(val))
    assert not dm._is_training((val_x, val_y))
    assert dm._batch_kind(True) == train.batch_kind()
    kind = train.batch_kind()
    del train, val
    assert dm._live_loaders() == [] and dm._batch_kind(True) == kind
