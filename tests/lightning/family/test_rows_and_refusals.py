"""The one planned-batch reader (read/rows.py): errors name shard, key and field; skips are counted
and logged once; backends that read an image and a label only refuse dict splits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fastdata import ShardDataModule, WorkerSettings
from fastdata.format.manifest_io import load_manifest
from fastdata.read.backends.cpu import make_cpu_loader
from fastdata.read.base import LoaderSpec
from fastdata.read.shardio import ShardReadError
from tests.lightning.family.conftest import rectangles, write_field_shards


def _spec(root: Path, **kw) -> LoaderSpec:
    options = dict(split="val", train=False, batch_size=4, preset="none", image_size=16)
    return LoaderSpec(manifest=load_manifest(root), **(options | kw))


def _corrupt_mask(root: Path, rects) -> str:
    """Write the val split with sample 5's mask not a PNG; returns that sample's key."""
    bad = rects[5].key

    def edit(rect, parts):
        return parts | ({"mask.png": b"not a png at all"} if rect.key == bad else {})

    write_field_shards(root, {"val": rects}, edit=edit)
    return bad


def test_a_bad_field_is_named_with_its_shard_key_and_field(tmp_path: Path) -> None:
    rects = rectangles(9, 3)
    root = tmp_path / "bad"
    bad = _corrupt_mask(root, rects)
    loader = make_cpu_loader(_spec(root))
    with pytest.raises(ShardReadError) as info:
        list(loader)
    message = str(info.value)
    assert "val-000000.tar" in message and repr(bad) in message and "field 'mask'" in message


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_a_skipped_sample_is_counted_and_logged_once(tmp_path: Path, caplog, backend) -> None:
    from fastdata.read.backends.memory import make_memory_loader

    rects = rectangles(9, 3)
    root = tmp_path / "bad"
    bad = _corrupt_mask(root, rects)
    make = make_cpu_loader if backend == "cpu" else make_memory_loader
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        loader = make(_spec(root, on_error="skip"))
        batches = list(loader) + list(loader)  # two epochs: still logged once
    keys = [m["key"] for b in batches for m, p in zip(b["meta"], b["padded"], strict=True) if not p]
    assert sorted(keys) == sorted(2 * [r.key for r in rects if r.key != bad])
    assert loader.skipped == (2 if backend == "cpu" else 1)  # cpu: counted per epoch read
    logged = [r for r in caplog.records if bad in r.getMessage()]
    assert len(logged) == 1 and "field 'mask'" in logged[0].getMessage()


@pytest.mark.parametrize("backend", ["nvjpeg", "dali"])
def test_gpu_decoders_refuse_a_dict_split_naming_the_backends_that_can(rect_shards, backend):
    if backend == "nvjpeg":
        from fastdata.read.backends.nvjpeg import NvjpegLoader as Loader
    else:
        from fastdata.read.backends.dali.loader import DaliLoader as Loader
    with pytest.raises(ValueError, match=r"backend='cpu' or 'memory'") as info:
        Loader(_spec(rect_shards))
    assert "mask (mask)" in str(info.value) and "boxes (boxes)" in str(info.value)


def test_auto_never_picks_a_gpu_decoder_for_a_dict_split(rect_shards):
    from fastdata.augment import get_preset
    from fastdata.read.backends.auto import choose_backend

    manifest = load_manifest(rect_shards)
    name, reason = choose_backend(
        manifest,
        "train",
        "cuda",
        32,
        preset=get_preset("photo", 32),
        available=lambda _name: (True, ""),
        free_memory=lambda _device: 1,  # nothing fits: a classification split gets a GPU decoder
    )
    assert name == "cpu" and "carries only an image and a label" in reason


def test_datamodule_refuses_a_gpu_decoder_for_a_dict_split_at_setup(rect_shards, monkeypatch):
    import fastdata.lightning.datamodule as datamodule

    monkeypatch.setattr(datamodule, "pick_backend", lambda *a, **k: "dali")
    dm = ShardDataModule(
        rect_shards,
        batch_size=4,
        backend="dali",
        image_size=16,
        workers=WorkerSettings(num_workers=0),
    )
    with pytest.raises(ValueError, match=r"use backend='cpu' or 'memory'"):
        dm.setup("fit")
    assert torch  # imported for the type of the batches elsewhere


@pytest.mark.parametrize("bad", [[-1], [7]])
@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_class_indices_outside_the_classes_are_named_never_wrapped(tmp_path, backend, bad):
    """A multi-label index of -1 used to wrap to the last class, and 7 (of 5 classes) crashed
    the collate past on_error='skip'; both are now the sample's field error."""
    import numpy as np

    from fastdata import ShardDataModule
    from fastdata.read.shardio import ShardReadError
    from tests.lightning.family.conftest import ALL_FIELDS, rectangles, write_field_shards

    fields = {k: ALL_FIELDS[k] for k in ("image", "mask", "labels")}

    def edit(rect, parts):
        if rect.key.endswith("_00001"):
            parts.update(ALL_FIELDS["labels"].encode(np.array(bad)))
        return parts

    root = tmp_path / "s"
    splits = {"train": rectangles(8, 1, fixed=(28, 28)), "val": rectangles(8, 2, fixed=(28, 28))}
    write_field_shards(root, splits, fields=fields, edit=edit)

    def module(on_error):
        dm = ShardDataModule(
            root,
            batch_size=8,
            backend=backend,
            train_transforms="none",
            drop_last=False,
            on_error=on_error,
            workers=WorkerSettings(num_workers=0),
        )
        dm.setup("fit")
        return dm

    with pytest.raises(ShardReadError, match=r"_00001.*labels.*outside the manifest's 5 classes"):
        list(module("raise").val_dataloader())
    batches = list(module("skip").val_dataloader())
    assert sum(len(b["padded"]) - int(b["padded"].sum()) for b in batches) == 7  # one skipped
