"""The one contract every backend fulfils: one plan, elastic exact resume, user transforms.

Samples' labels equal their ids (`unique_label_source`), so a label sequence names the samples.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from fastdata import ShardDataModule, WorkerSettings
from fastdata.augment import Preset, get_preset
from fastdata.read import BACKENDS
from fastdata.read.plan import PAD_LABEL
from fastdata.read.resume import ResumeError

dali_ok = BACKENDS["dali"].check()[0]
LOCAL = ["cpu", "memory"] + (["dali"] if dali_ok else [])
CPU = torch.device("cpu")


def _dm(root: Path, backend: str, **kw) -> ShardDataModule:
    kw.setdefault("batch_size", 10)
    kw.setdefault("workers", WorkerSettings(num_workers=0))
    kw.setdefault("seed", 7)
    dm = ShardDataModule(root, backend=backend, **kw)
    dm.setup("fit")
    return dm


def _epoch(dm: ShardDataModule, loader=None, limit: int | None = None) -> list[list[int]]:
    loader = loader if loader is not None else dm.train_dataloader()
    out = []
    for step, batch in enumerate(loader):
        if limit is not None and step == limit:
            break
        _, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batch, CPU, 0), 0)
        out.append(y.tolist())
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_backends_yield_the_same_labels_and_ranks_cover_the_epoch(tiny_shards, world):
    per_backend = {}
    for backend in LOCAL:
        ranks = [_epoch(_dm(tiny_shards, backend, rank=r, world_size=world)) for r in range(world)]
        per_backend[backend] = ranks
    reference = per_backend["cpu"]
    for backend, ranks in per_backend.items():
        assert ranks == reference, backend
    counts = Counter(y for rank in reference for batch in rank for y in batch)
    assert set(counts) == set(range(300))  # drop_last keeps whole steps: 300 = 30 x 10
    assert len({len(rank) for rank in reference}) == 1


def test_cpu_and_memory_give_the_same_augmented_batches(tiny_shards):
    batches = {}
    for backend in ("cpu", "memory"):
        dm = _dm(tiny_shards, backend, train_transforms="cifar")
        x, _ = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
        batches[backend] = x
    assert torch.allclose(batches["cpu"], batches["memory"], atol=1e-5)


def _consume(root, world, batch, k, backend="cpu"):
    """Take k steps on `world` ranks; return (samples seen, the rank-0 state)."""
    seen, state = [], None
    for r in range(world):
        dm = _dm(root, backend, rank=r, world_size=world, batch_size=batch)
        seen += [y for b in _epoch(dm, limit=k) for y in b]
        state = state or dm.state_dict()
    return seen, state


@pytest.mark.parametrize("before,after", [((2, 10), (1, 20)), ((1, 20), (2, 10))])
@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_elastic_resume_without_a_trainer(tiny_shards, before, after, backend):
    seen, state = _consume(tiny_shards, *before, k=3, backend=backend)
    world, batch = after
    resumed = []
    for r in range(world):
        dm = ShardDataModule(
            tiny_shards,
            backend=backend,
            batch_size=batch,
            seed=7,
            rank=r,
            world_size=world,
            drop_last=False,
            workers=WorkerSettings(num_workers=0),
        )
        dm.load_state_dict(state)
        dm.setup("fit")
        loader = dm.train_dataloader()
        expected = len(loader)  # before iteration: the batches taken + the rest
        batches = _epoch(dm, loader)
        assert expected == 3 + len(batches)
        resumed += [y for b in batches for y in b]
    counts = Counter(seen + resumed)
    assert set(counts) == set(range(300))
    assert sum(counts.values()) - 300 <= world - 1  # repeats only by the padding rule


def test_resume_refuses_another_seed_or_dataset(tiny_shards, tmp_path):
    _, state = _consume(tiny_shards, 1, 10, k=2)
    with pytest.raises(ResumeError, match="seed=7"):
        ShardDataModule(tiny_shards, seed=8, workers=WorkerSettings(num_workers=0)).load_state_dict(
            state
        )
    other = dict(state, dataset="0" * 16)
    with pytest.raises(ResumeError, match="another dataset"):
        ShardDataModule(tiny_shards, seed=7, workers=WorkerSettings(num_workers=0)).load_state_dict(
            other
        )
    with pytest.raises(ResumeError, match="older fastdata"):
        ShardDataModule(tiny_shards, workers=WorkerSettings(num_workers=0)).load_state_dict(
            {"epoch": 0, "batches_seen": 3}
        )


def test_eval_padding_is_marked_and_every_sample_counted_once(tiny_shards):
    labels = []
    for r in range(3):  # 50 test samples on 3 ranks: one padding sample
        dm = _dm(tiny_shards, "cpu", rank=r, world_size=3, batch_size=8)
        for batch in dm.test_dataloader():
            labels += batch[1].tolist()
    assert labels.count(PAD_LABEL) == 1
    assert sorted(y for y in labels if y != PAD_LABEL) == list(range(50))


def test_no_val_split_warns_and_never_uses_training_data(tiny_shards, caplog):
    dm = _dm(tiny_shards, "cpu", splits={"train": "train"})
    dm.split_names.pop("val", None)
    assert dm.val_dataloader() == []
    assert "no validation split" in caplog.text


def _flip_all(x: torch.Tensor) -> torch.Tensor:
    """A user transform: mirror every image (uint8 in, uint8 out)."""
    return x.flip(-1)


@pytest.mark.parametrize("backend", LOCAL)
def test_user_transforms_run_on_uint8_batches_or_fail_clearly(tiny_shards, backend):
    kw = dict(train_transforms=_flip_all, mean=(0, 0, 0), std=(1, 1, 1))
    if not BACKENDS[backend].user_transforms:
        with pytest.raises(ValueError, match="cannot run"):
            _dm(tiny_shards, backend, **kw).train_dataloader()
        return
    dm = _dm(tiny_shards, backend, **kw)
    raw = next(iter(dm.train_dataloader()))[0]
    x, _ = dm.on_after_batch_transfer((raw, torch.zeros(len(raw))), 0)
    assert x.dtype == torch.float32 and torch.equal(x, raw.flip(-1).float())


def test_typed_preset_and_dataset_statistics(tiny_shards):
    dm = _dm(tiny_shards, "cpu")
    info = dm.manifest.split("train")
    assert info.pixel_mean is not None and dm.transforms.mean == tuple(info.pixel_mean)
    custom = Preset("mine", None, (1.0, 2.0, 3.0), (4.0, 5.0, 6.0), get_preset("cifar").train_ops)
    dm2 = _dm(tiny_shards, "memory", train_transforms=custom)
    assert dm2.transforms.mean == (1.0, 2.0, 3.0)
    loader = dm2.train_dataloader().loader
    assert loader.applied_ops == 1 and not loader.normalized  # the memory backend fused the PadCrop


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_a_wide_image_keeps_its_edge_box_on_every_backend(tmp_path, backend):
    """Issue 29's repro: a 300x150 image with COCO bbox [0, 50, 40, 40] beside a 200x200 one,
    image_size=128: the eval loader resizes the whole image (no crop), so the box is scaled, not
    cut (the memory backend's former centre-window store dropped it)."""
    from fastdata import DetectionDataModule
    from tests.lightning.family.conftest import Rect, write_field_shards

    rects = [Rect("wide", (150, 300), (0, 50, 40, 90), 1), Rect("square", (200, 200), (50, 50, 100, 100), 2)]  # fmt: skip
    root = write_field_shards(tmp_path / "d", {"train": rects, "val": rects})
    dm = DetectionDataModule(
        root, backend=backend, image_size=128, batch_size=2, workers=WorkerSettings(num_workers=0)
    )
    dm.setup("validate")
    boxes = {
        m["key"]: b.cpu()
        for batch in dm.prepared(dm.val_dataloader(), CPU)
        for m, b in zip(batch["meta"], batch["boxes"], strict=True)
    }
    expected = {
        "wide": [[0.0, 128 / 3, 40 * 128 / 300, 76.8]],
        "square": [[32.0, 32.0, 64.0, 64.0]],
    }
    for key, box in expected.items():
        assert boxes[key].shape == (1, 4), (key, boxes[key])  # not cut away
        assert torch.allclose(boxes[key], torch.tensor(box), atol=1e-4), (key, boxes[key])
